"""The software a record was made with: the installed version of each package it names (scores.json's "environment",
the report page, `flowrl rewards list`). Imports no torch."""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version

NOT_INSTALLED = "not installed"


def package_versions(packages: Iterable[str]) -> dict[str, str]:
    """{package: its installed version, or 'not installed'} in the order given."""
    out = {}
    for package in packages:
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = NOT_INSTALLED
    return out


def installed(package: str) -> bool:
    return package_versions([package])[package] != NOT_INSTALLED
