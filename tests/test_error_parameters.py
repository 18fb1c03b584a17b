"""Errors name parameters: every ``{name}`` the package writes into an error is a registered parameter,
the CLI spells it as the command's flag, and braces from a user's data are left alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import balancer_cli
from balancer_cli.errors import PARAMETERS, SampleError, UsageError

PACKAGE = Path(balancer_cli.__file__).parent
PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\[[A-Za-z_][A-Za-z0-9_-]*\])?\}")


def _error_texts():
    """``(file:line, text)`` of each string literal in a call of a ``...Error`` class."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if not name.endswith("Error"):
                continue
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                for sub in ast.walk(arg):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        yield f"{path.relative_to(PACKAGE.parent)}:{sub.lineno}", sub.value


def test_every_parameter_named_in_an_error_is_registered():
    unknown = [f"{where}: {{{m.group(1)}}}" for where, text in _error_texts() for m in PARAMETER.finditer(text)
               if m.group(1) not in PARAMETERS]
    assert not unknown, "register these in balancer_cli.errors.PARAMETERS:\n" + "\n".join(unknown)
    assert sum(1 for _, text in _error_texts() if PARAMETER.search(text)) > 20  # the walk finds them


def test_parameters_are_spelled_per_caller():
    error = UsageError("{caps[vision]} 3 is smaller than every sample", fix="raise {caps[vision]} or {world_size}")
    assert str(error) == "caps[vision] 3 is smaller than every sample; fix: raise caps[vision] or world_size"
    flags = {"caps[vision]": "--max-vision-items", "world_size": "--dp", "caps": "--cap"}
    assert error.for_flags(flags) == ("--max-vision-items 3 is smaller than every sample; "
                                      "fix: raise --max-vision-items or --dp")
    assert UsageError("{caps[mel]} 2").for_flags(flags) == "--cap mel 2"


def test_braces_from_user_data_are_kept():
    error = SampleError("width='{w}' is not a number; path data/{split}.json", file="a.jsonl", line=3)
    assert str(error) == "a.jsonl:3: width='{w}' is not a number; path data/{split}.json"
    assert error.for_flags({"world_size": "--dp"}) == str(error)
