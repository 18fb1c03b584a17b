"""The CLI surface: a frozen snapshot of every command's options, and every quoted flag is real.

A change to any option (name, type, default, choices) fails ``test_options_match_the_snapshot``
with the difference; regenerate the snapshot on purpose with
``BALANCER_UPDATE_SNAPSHOT=1 python -m pytest tests/cli/test_cli_surface.py`` and review its diff.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import click
import pytest

import balancer_cli
from balancer_cli.cli import main
from balancer_cli.cli._render import NAMED_ENCODERS
from balancer_cli.planners.flags import EXTERNAL_FLAGS

SNAPSHOT = Path(__file__).with_name("cli_surface.json")
PACKAGE = Path(balancer_cli.__file__).parent
#: ``--flag`` quoted in the package's code and text; a ``{module}`` or ``<m>`` placeholder stands for
#: a module name. Arrows (``--scan/-->``) are not flags.
QUOTED_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-(?:[a-z0-9]+|\{[a-z_]+\}|<[a-z]+>))*)(?![\w/>{<-])")


def _commands() -> dict[str, click.Command]:
    ctx = click.Context(main)
    return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}


def _describe(param: click.Parameter) -> dict:
    kind = param.type
    entry = {"kind": "option" if isinstance(param, click.Option) else "argument", "name": param.name,
             "opts": sorted(param.opts), "type": kind.name, "required": param.required,
             "multiple": param.multiple, "nargs": param.nargs}
    if isinstance(kind, click.Choice):
        entry["choices"] = list(kind.choices)
    if isinstance(param, click.Option):
        entry["is_flag"] = param.is_flag
        default = param.default
        entry["default"] = default if isinstance(default, (str, int, float, bool, type(None))) else repr(default)
    return entry


def surface() -> dict:
    """Every command's parameters, in declaration order."""
    return {name: [_describe(p) for p in command.params] for name, command in _commands().items()}


def balancer_flags() -> set[str]:
    """Every ``--flag`` some balancer command takes (the group's own ``--version`` and ``--help`` too)."""
    flags = {"--version", "--help"}
    for command in _commands().values():
        for param in command.params:
            flags.update(o for o in param.opts + param.secondary_opts if o.startswith("--"))
    return flags


def test_options_match_the_snapshot():
    current = surface()
    if os.environ.get("BALANCER_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    frozen = json.loads(SNAPSHOT.read_text())
    assert sorted(current) == sorted(frozen), "commands were added or removed"
    for name in frozen:
        assert current[name] == frozen[name], f"`balancer {name}` options changed (see the module docstring)"


def _expansions(flag: str) -> list[str]:
    if "{" not in flag and "<" not in flag:
        return [flag]
    return [re.sub(r"\{[a-z_]+\}|<[a-z]+>", module, flag) for module in (*NAMED_ENCODERS, "llm")]


def test_every_quoted_flag_exists_on_some_command():
    """Advice in an error, help text or docstring never names a flag that no command has."""
    known = balancer_flags() | set(EXTERNAL_FLAGS)
    unknown = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in QUOTED_FLAG.finditer(line):
                flag = "--" + match.group(1)
                if not any(f in known for f in _expansions(flag)):
                    unknown.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {flag}")
    assert not unknown, "flags that exist on no command:\n" + "\n".join(unknown)


@pytest.mark.parametrize("args, flag", [
    (["pack", "LENGTHS", "-o", "OUT", "--dp", "500", "--max-llm-tokens", "5000", "--max-vision-items", "12"],
     "--dp 500 x --micro-batches 1 needs 500 groups per step"),
    (["pack", "LENGTHS", "-o", "OUT", "--max-llm-tokens", "10", "--max-vision-items", "5"],
     "--max-llm-tokens 10 is smaller than every sample"),
    (["pack", "LENGTHS", "-o", "OUT", "--cap", "llm=5000", "--cap", "vision=12", "--bound", "vision=13",
      "--algorithm", "isf"], "--bound vision 13 exceeds its cap 12"),
])
def test_library_errors_read_as_the_commands_flags(tmp_path, args, flag):
    import numpy as np
    from click.testing import CliRunner

    from balancer_cli.lengths import make_lengths_table, write_lengths

    rng = np.random.default_rng(0)
    items = rng.integers(1, 7, 100)
    write_lengths(make_lengths_table(rng.integers(200, 3000, 100), {"vision": (items * 256, items)}),
                  tmp_path / "lengths.parquet")
    args = [str(tmp_path / "lengths.parquet") if a == "LENGTHS" else str(tmp_path / "out") if a == "OUT" else a
            for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert flag in result.output and "{" not in result.output
