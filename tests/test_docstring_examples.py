"""Every docstring example in the package runs and prints what it shows (torch adapters only where
torch is installed)."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
from pathlib import Path

import pytest

import balancer_cli

PACKAGE = Path(balancer_cli.__file__).parent
MODULES = sorted(
    ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    for path in PACKAGE.rglob("*.py")
    if (parts := list(path.relative_to(PACKAGE.parent).with_suffix("").parts))[-1] != "__main__"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if ".runtime" in name and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    failed, _ = doctest.testmod(importlib.import_module(name))
    assert failed == 0
