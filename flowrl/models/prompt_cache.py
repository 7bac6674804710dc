"""The encoded-prompt cache of a pipeline adapter: least recently used entries go first once a byte bound is reached.

An SD3 prompt with its negative is about 5 MiB of embeddings (T5 tokens x 4096 in bf16), so a run over tens of thousands
of prompts would fill a GPU if nothing were forgotten. `max_bytes` bounds the cache; `device="cpu"` keeps the entries in
host memory and `get` copies one batch's rows to the model's device (docs/models.md#prompt-cache).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from flowrl.types import Cond

DEVICES = ("model", "cpu")


class PromptCache:
    """key -> Cond rows [1]; at most `max_bytes` of tensors held, evicting the least recently used entry first."""

    def __init__(self, max_bytes: int = 2 * 1024**3, device: str = "model"):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(
                f"model.prompt_cache_max_bytes={max_bytes!r} must be a whole number of bytes >= 0 (e.g. 2147483648)"
            )
        if device not in DEVICES:
            raise ValueError(f"model.prompt_cache_device={device!r} must be one of {', '.join(DEVICES)}")
        self.max_bytes = max_bytes
        self.device = device
        self.nbytes = 0
        self._entries: OrderedDict[tuple, Cond] = OrderedDict()

    @staticmethod
    def size(cond: Cond) -> int:
        return sum(t.numel() * t.element_size() for t in cond.values())

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, device: torch.device) -> Cond:
        """The entry's rows on `device` (marked most recently used)."""
        self._entries.move_to_end(key)
        return {name: t.to(device, non_blocking=True) for name, t in self._entries[key].items()}

    def put(self, key: tuple, cond: Cond) -> None:
        """Keep `cond` (on the CPU when device="cpu"), then evict least recently used entries down to `max_bytes`; an
        entry larger than the bound alone is not kept."""
        if key in self._entries:
            self.nbytes -= self.size(self._entries.pop(key))
        size = self.size(cond)
        if size > self.max_bytes:
            return
        if self.device == "cpu":
            cond = {name: t.to("cpu") for name, t in cond.items()}
        self._entries[key] = cond
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.nbytes -= self.size(oldest)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
