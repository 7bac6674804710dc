"""Flat name -> class registries.

Entries come from three places: classes in this tree that register with the decorator, installed packages
that declare an entry point in the registry's group (e.g. `flowrl.rewards`), and dotted paths
(`my_lab.rewards.HandReward`) for code outside the tree.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any


class Registry:
    def __init__(self, kind: str, package: str | None = None, entry_point_group: str | None = None):
        self.kind = kind
        self.package = package  # in-tree package whose modules register on import
        self.entry_point_group = entry_point_group
        self._entries: dict[str, type] = {}
        self._populated = False

    def register(self, name: str) -> Callable[[type], type]:
        def decorator(cls: type) -> type:
            existing = self._entries.get(name)
            if existing is not None and existing is not cls:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered to {existing.__module__}.{existing.__qualname__}"
                )
            self._entries[name] = cls
            cls.registry_name = name
            return cls

        return decorator

    def _populate(self) -> None:
        if self._populated:
            return
        self._populated = True
        if self.package:
            pkg = importlib.import_module(self.package)
            for info in pkgutil.iter_modules(getattr(pkg, "__path__", [])):  # a plain module registers on import
                if not info.name.startswith("_"):
                    importlib.import_module(f"{self.package}.{info.name}")
        if self.entry_point_group:
            for ep in entry_points(group=self.entry_point_group):
                if ep.name not in self._entries:
                    self._entries[ep.name] = ep.load()

    def names(self) -> list[str]:
        self._populate()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._populate()
        return name in self._entries

    def get(self, name: str) -> type:
        self._populate()
        if name in self._entries:
            return self._entries[name]
        if "." in name:
            module_name, _, attr = name.rpartition(".")
            try:
                module = importlib.import_module(module_name)
            except ImportError as err:
                raise KeyError(f"{self.kind} {name!r}: cannot import module {module_name!r} ({err})") from None
            if not hasattr(module, attr):
                raise KeyError(f"{self.kind} {name!r}: module {module_name!r} has no attribute {attr!r}")
            return getattr(module, attr)
        close = difflib.get_close_matches(name, self._entries, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown {self.kind} {name!r}.{hint} Registered: {', '.join(sorted(self._entries))}")

    def build(self, name: str, **kwargs: Any) -> Any:
        return self.get(name)(**kwargs)


REWARDS = Registry("reward", package="flowrl.rewards", entry_point_group="flowrl.rewards")
SAMPLERS = Registry("sampler", package="flowrl.samplers")
BALANCERS = Registry("balancer", package="flowrl.balancers")
