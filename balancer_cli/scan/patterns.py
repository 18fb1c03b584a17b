"""Input patterns: WebDataset's brace notation (``shard-{000000..000099}.tar``) and shell globs,
for inputs the shell did not expand (quoted, or from a config file).

A path that exists is taken as written, whatever characters it holds. Otherwise braces expand as
``braceexpand`` (what WebDataset uses) does for the forms datasets use: numeric ranges
``{a..b}`` (zero-padded to the wider bound when a bound has a leading zero; descending when
``a > b``), letter ranges ``{a..c}``, comma lists ``{x,y}``, several groups in one path (their product, left to right);
then each result is a glob when it holds ``*``, ``?`` or ``[`` (matches sorted by name). A
pattern that matches nothing is an error naming it.

Example:
    >>> brace_expand("data/shard-{008..011}.tar")
    ['data/shard-008.tar', 'data/shard-009.tar', 'data/shard-010.tar', 'data/shard-011.tar']
    >>> brace_expand("{a,b}/{1..2}.tar")
    ['a/1.tar', 'a/2.tar', 'b/1.tar', 'b/2.tar']
"""

from __future__ import annotations

import glob
import os
import re

from balancer_cli.errors import InputError, UsageError

__all__ = ["MAX_EXPANSION", "brace_expand", "expand_pattern", "is_pattern"]

#: Most paths one pattern may expand to (a typo like ``{0..99999999}`` must not eat the memory).
MAX_EXPANSION = 1_000_000
_GROUP = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
_LETTERS = re.compile(r"([a-zA-Z])\.\.([a-zA-Z])")
_GLOB = re.compile(r"[*?\[]")


def is_pattern(path: str) -> bool:
    """Whether ``path`` holds a brace group or glob characters (and so may be a pattern)."""
    return bool(_GROUP.search(path) or _GLOB.search(path))


def _alternatives(body: str) -> list[str] | None:
    match = _RANGE.fullmatch(body)
    if match:
        lo, hi = match.groups()
        a, b = int(lo), int(hi)
        padded = any(len(x.lstrip("-")) > 1 and x.lstrip("-").startswith("0") for x in (lo, hi))
        width = max(len(lo), len(hi)) if padded else 0
        if abs(b - a) + 1 > MAX_EXPANSION:
            raise UsageError(f"the range {{{body}}} holds {abs(b - a) + 1:,} values",
                             fix=f"split the inputs: at most {MAX_EXPANSION:,} paths per pattern")
        step = 1 if b >= a else -1
        return [str(v).zfill(width) if v >= 0 else "-" + str(-v).zfill(width - 1) for v in range(a, b + step, step)]
    match = _LETTERS.fullmatch(body)
    if match:
        a, b = (ord(c) for c in match.groups())
        return [chr(c) for c in (range(a, b + 1) if b >= a else range(a, b - 1, -1))]
    if "," in body:
        return body.split(",")
    return None  # "{}" or "{x}": literal braces, as braceexpand keeps them


def brace_expand(pattern: str) -> list[str]:
    """Every path a brace pattern names, in order (no filesystem access).

    Raises:
        UsageError: a pattern naming more than :data:`MAX_EXPANSION` paths.
    """
    out, pending = [], [("", pattern)]
    while pending:
        done, rest = pending.pop()
        match = _GROUP.search(rest)
        options = _alternatives(match.group(1)) if match else None
        while match is not None and options is None:  # literal braces: keep them, look further
            done, rest = done + rest[:match.end()], rest[match.end():]
            match = _GROUP.search(rest)
            options = _alternatives(match.group(1)) if match else None
        if match is None:
            out.append(done + rest)
            continue
        head, tail = done + rest[:match.start()], rest[match.end():]
        pending.extend((head + option, tail) for option in reversed(options))
        if len(out) + len(pending) > MAX_EXPANSION:
            raise UsageError(f"{pattern!r} names more than {MAX_EXPANSION:,} paths",
                             fix=f"split the inputs: at most {MAX_EXPANSION:,} paths per pattern")
    return out


def expand_pattern(path: str) -> list[str]:
    """The inputs ``path`` stands for: itself when it exists, else its brace and glob expansion.

    Raises:
        InputError: a pattern matching no file, or a brace expansion naming a missing file.
    """
    if os.path.exists(path) or not is_pattern(path):
        return [path]
    found: list[str] = []
    for item in brace_expand(path):
        if _GLOB.search(item) and not os.path.exists(item):
            matches = sorted(glob.glob(item))
            if not matches:
                raise InputError(f"{item}: no file matches the pattern", fix="check the pattern and the folder")
            found += matches
        elif os.path.exists(item):
            found.append(item)
        else:
            raise InputError(f"{item}: no such file (from the pattern {path})", fix="check the pattern's range")
    return found
