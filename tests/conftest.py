"""Shared pytest fixtures: paths to the real data beside the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
SAMPLE_DATA = ROOT / "sample_data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (always present in CI); tests skip with a reason when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it is always present in CI)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def internvl_lengths(shared_data: Path) -> list[Path]:
    """The four OmniBal/InternVL token-length JSON files, sorted by name."""
    return sorted((shared_data / "internvl-lengths").glob("*.json"))
