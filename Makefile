# The README quickstart: `make demo` and `make test`, each creating or refreshing .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flowrl-installed
# torch and torchvision must come as this pair (the pair that imports together with open_clip here; see the README)
TORCH := torch==2.14.1 torchvision==0.29.1
PYTEST_ARGS ?= -q
# two pytest-xdist workers, each test module on one worker (its module fixtures built once); XDIST= runs serially.
# One torch/OpenMP thread per process (workers and the runs they launch): two workers on two cores, each with two
# spin-waiting threads, burned a third more CPU than the tests need (22 CPU-minutes for a 12-minute suite).
XDIST ?= -n 2 --dist loadfile
TEST_THREADS ?= 1

.PHONY: demo test lint venv clean

venv: $(STAMP)

# extras: ocr = rapidocr + onnxruntime (the default OCR backend, its models inside the wheel); tesseract =
# pytesseract (pure Python), so the tesseract backend's tests run wherever the binary is (.ci/run installs it);
# serve = Ray Serve, so the reward service's tests run against a real local Ray
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test,ocr,tesseract,video,serve]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flowrl demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
