"""Fixtures of the runtime tests (torch imported where a fixture is used: tests/runtime needs it)."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def env(monkeypatch):
    """A clean environment: no RANK/WORLD_SIZE, no process group, no Megatron."""
    torch = pytest.importorskip("torch")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    return monkeypatch
