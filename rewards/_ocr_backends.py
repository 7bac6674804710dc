"""The text readers behind the ocr reward: RapidOCR (PP-OCR ONNX models shipped inside the rapidocr wheel, run by
onnxruntime) and tesseract (the Debian binary through pytesseract). Each reader maps one PIL image to a string.

RapidOCR never downloads: its three models are named explicitly as the files in the installed wheel, so a missing
file raises FileNotFoundError instead of a download.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

# pip packages each backend imports (OCRReward.extra_requires); the pyproject extra that installs them
REQUIRES = {"rapidocr": ("rapidocr", "onnxruntime"), "tesseract": ("pytesseract",)}
EXTRAS = {"rapidocr": "ocr", "tesseract": "tesseract"}

# the rapidocr 3.10 wheel's own models: PP-OCRv6 small detection and recognition (multilingual, the recognizer
# carries its character list), the v2.0 mobile 0/180-degree classifier; the same files its defaults resolve to
RAPIDOCR_MODELS = {
    "Det": "PP-OCRv6_det_small.onnx",
    "Rec": "PP-OCRv6_rec_small.onnx",
    "Cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",
}


def _missing_package(backend: str) -> ImportError:
    packages = " and ".join(REQUIRES[backend])
    return ImportError(f"ocr: backend={backend!r} needs {packages}; pip install 'flowrl[{EXTRAS[backend]}]'")


class RapidOCRReader:
    """PP-OCR detection, orientation and recognition on onnxruntime's CPU provider; lines joined by spaces."""

    def __init__(self, num_threads: int = 1, det_limit_side_len: int = 960):
        try:
            import rapidocr
            from rapidocr import RapidOCR
        except ImportError:
            raise _missing_package("rapidocr") from None
        folder = Path(rapidocr.__file__).parent / "models"
        params: dict[str, Any] = {f"{task}.model_path": str(folder / name) for task, name in RAPIDOCR_MODELS.items()}
        for path in params.values():
            if not Path(path).is_file():
                raise FileNotFoundError(
                    f"ocr: {path} is missing from the rapidocr wheel; pip install 'rapidocr==3.10.*'"
                )
        params |= {
            "Global.log_level": "error",
            "EngineConfig.onnxruntime.intra_op_num_threads": int(num_threads),
            # downscale only images larger than this; rapidocr's default ("min" 736) upscales a 256x64 sign to
            # 2944x736, 15x the time for no better read
            "Det.limit_type": "max",
            "Det.limit_side_len": int(det_limit_side_len),
        }
        self._engine = RapidOCR(params=params)

    def __call__(self, image: Any) -> str:
        result = self._engine(np.asarray(image.convert("RGB")))
        return " ".join(result.txts or ())  # txts is None when no text is found


class TesseractReader:
    """The tesseract binary (Debian: tesseract-ocr) through pytesseract, with its command-line config."""

    def __init__(self, config: str = "--psm 6"):
        try:
            import pytesseract
        except ImportError:
            raise _missing_package("tesseract") from None
        if shutil.which(pytesseract.pytesseract.tesseract_cmd) is None:
            raise FileNotFoundError(
                "ocr: the tesseract binary is not on PATH; install it (Debian: apt-get install tesseract-ocr) "
                "or use backend='rapidocr'"
            )
        self._pytesseract, self.config = pytesseract, config

    def __call__(self, image: Any) -> str:
        return self._pytesseract.image_to_string(image, config=self.config)


def build_reader(backend: str, num_threads: int, tesseract_config: str) -> RapidOCRReader | TesseractReader:
    if backend == "rapidocr":
        return RapidOCRReader(num_threads=num_threads)
    if backend == "tesseract":
        return TesseractReader(config=tesseract_config)
    valid = ", ".join(repr(b) for b in REQUIRES)
    raise ValueError(f"ocr: backend={backend!r} is not a known backend; valid values: {valid}")
