"""Tokenizers of the tiny pipelines, built in code with the real transformers classes (no download).

Character- or byte-level vocabularies without merges: a prompt becomes one token per character, which is all a
tiny random text encoder needs, and `len(tokenizer)` is that of a real, non-empty tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path


def _byte_unicode_table() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE vocabularies (GPT-2/CLIP convention)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def clip_tokenizer(folder: Path):
    """A character-level CLIP tokenizer (CLIP's byte alphabet, no merges): 514 tokens, max length 77."""
    from transformers import CLIPTokenizer

    chars = _byte_unicode_table()
    vocab = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"), model_max_length=77)


def t5_tokenizer(max_length: int = 64):
    """A character-level unigram T5 tokenizer (lowercase letters, digits, punctuation; 100 extra ids)."""
    from transformers import T5TokenizerFast

    pieces = ["<pad>", "</s>", "<unk>", "▁"] + [f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"-")
    vocab = [(p, 0.0 if i < 3 else -float(i)) for i, p in enumerate(pieces)]
    return T5TokenizerFast(vocab=vocab, extra_ids=100, model_max_length=max_length)


def gemma_tokenizer(max_length: int = 64):
    """A byte-level BPE Gemma tokenizer without merges (characters only)."""
    from transformers import GemmaTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    chars = [chr(c) for c in range(32, 127)] + ["▁"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = GemmaTokenizerFast(vocab=vocab, merges=[], model_max_length=max_length)
    tok.padding_side = "right"
    return tok


def qwen2_tokenizer(max_length: int = 2048):
    """A byte-level BPE Qwen2 tokenizer without merges (the byte alphabet) and Qwen's chat special tokens."""
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(_byte_unicode_table() + specials)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=max_length)
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    tok.padding_side = "right"
    return tok


# Qwen3's chat layout, with the empty think block that `enable_thinking=False` asks for (FLUX.2 [klein] prompts)
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
