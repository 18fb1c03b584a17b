"""``import balancer_cli`` and every module outside ``runtime/`` work where torch is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import balancer_cli

PACKAGE = Path(balancer_cli.__file__).parent

# torch is made unimportable (as if not installed) before anything else runs.
_PROBE = """
import importlib, sys
sys.modules["torch"] = None
names = sys.argv[1:]
for name in names:
    importlib.import_module(name)
from click.testing import CliRunner
from balancer_cli.cli import main
result = CliRunner().invoke(main, ["--help"])
assert result.exit_code == 0, result.output
for command in main.list_commands(None):
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, (command, result.output)
assert sys.modules["torch"] is None
print(len(names))
"""


def test_every_module_but_runtime_imports_without_torch():
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if "runtime" in parts or parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    run = subprocess.run([sys.executable, "-c", _PROBE, *names], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.strip().splitlines()[-1]) == len(names) > 50
