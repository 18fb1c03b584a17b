"""The registries of ``balancer scan`` (engines, record readers, block ranges) and the flags its messages quote."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from balancer_cli.cli.cmd_scan import command
from balancer_cli.errors import UsageError
from balancer_cli.planners.flags import EXTERNAL_FLAGS
from balancer_cli.scan.blocks import _RANGES
from balancer_cli.scan.engines import ENGINES, get_engine
from balancer_cli.scan.engines.local import run_blocks as run_local
from balancer_cli.scan.inputs import FORMATS, RECORD_FORMATS
from balancer_cli.scan.readers import READERS

ROOT = Path(__file__).resolve().parents[2]


def test_engines_by_name():
    assert list(ENGINES) == ["local", "ray"]
    assert get_engine("local") is run_local
    assert get_engine("ray").__module__ == "balancer_cli.scan.engines.ray"


@pytest.mark.parametrize("name", ["warp", "Local", "__init__", "engines.local", ""])
def test_unknown_engine_is_a_usage_error(name):
    with pytest.raises(UsageError) as info:
        get_engine(name)
    assert str(info.value) == f"unknown --engine {name!r}; fix: use --engine local"


def test_engine_without_its_dependencies_says_what_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "balancer_cli.scan.engines.ray", raising=False)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # the import of the engine's module fails
    with pytest.raises(UsageError) as info:
        get_engine("ray")
    assert str(info.value) == ("--engine ray needs 'pyarrow.parquet', which is not installed; "
                               "fix: pip install 'balancer_cli[ray]'")


def test_every_record_format_has_a_reader_and_block_ranges():
    assert RECORD_FORMATS == tuple(f for f in FORMATS if f != "internvl-meta")
    assert set(READERS) == set(_RANGES) == set(RECORD_FORMATS)


def test_scan_messages_quote_only_flags_of_balancer_scan():
    """Stricter than any command's flag: scan's messages advise flags of `balancer scan` itself."""
    flags = {opt for param in command.params for opt in param.opts if opt.startswith("--")} | {"--help"}
    files = [*(ROOT / "balancer_cli" / "scan").rglob("*.py"), ROOT / "balancer_cli" / "cli" / "cmd_scan.py"]
    quoted = {flag for path in files for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", path.read_text())}
    assert quoted - EXTERNAL_FLAGS <= flags, sorted(quoted - EXTERNAL_FLAGS - flags)
