"""OmniBal/InternVL token-length JSON files (``[{"vit_num": .., "token_num": ..}, ...]``) as lengths.

OmniBal's released lengths are such lists, one file per dataset: ``vit_num`` (448 px tiles) and
``token_num`` (the LLM sequence). :func:`~balancer_cli.lengths.read_lengths` reads any input that
is not Parquet with :func:`read_omnibal_json`, which names a file of neither format by its first
bytes rather than a JSON parser's position.

Example:
    >>> import json, pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "docvqa.json"
    >>> _ = path.write_text(json.dumps([{"vit_num": 2, "token_num": 700}]))
    >>> table = read_omnibal_json(path)
    >>> table.column("vision_tokens").to_pylist(), table.column("source").to_pylist()
    ([512], ['docvqa'])
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from balancer_cli.errors import InputError

__all__ = ["read_omnibal_json", "TOKENS_PER_TILE"]

#: InternVL's vision tokens per 448 px tile (after pixel shuffle).
TOKENS_PER_TILE = 256
_FIX = "pass a lengths Parquet file or an OmniBal token-length JSON list"
#: Bytes read at a time; the records read so far are parsed up to the last record end.
_CHUNK_BYTES = 1 << 20
#: A record's end and the comma after it.
_RECORD_END = re.compile(rb"}\s*,")


def read_omnibal_json(path: str | os.PathLike) -> pa.Table:
    """Read an OmniBal/InternVL token-length JSON file (``[{"vit_num", "token_num"}, ...]``).

    ``vit_num`` becomes ``vision_items``, ``token_num`` becomes ``llm_tokens``; ``vision_tokens``
    is :data:`TOKENS_PER_TILE` per tile, the source is the file stem. A UTF-8 byte order mark is
    allowed.

    Raises:
        InputError: the file is not a JSON list (named with its first bytes when it does not
            even start like one), is empty, or holds a record without integer fields.
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()
        if not head.startswith(b"["):  # neither format: say what it starts with, not where a parser failed
            raise InputError(f"{path}: neither a lengths Parquet file nor an OmniBal token-length JSON list "
                             f"(it starts with {head[:16]!r})",
                             fix="pass the Parquet file `balancer scan` wrote, or a JSON list of "
                                 "{'vit_num', 'token_num'}")
        fields = _streamed_fields(path)
        if fields is None:  # not a plain list of flat records, or not valid: parsed whole, for its error
            records = json.loads(path.read_text(encoding="utf-8-sig"))
            if not isinstance(records, list) or not records:
                raise InputError(f"{path}: expected a non-empty JSON list of {{'vit_num', 'token_num'}} records",
                                 fix=_FIX)
            fields = _fields(path, records)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read token-length JSON ({exc})", fix=_FIX) from None
    items, llm = fields
    return pa.table({
        "source": pa.DictionaryArray.from_arrays(pa.array(np.zeros(len(items), np.int32)), pa.array([path.stem])),
        "llm_tokens": pa.array(llm),
        "vision_tokens": pa.array(items * TOKENS_PER_TILE),
        "vision_items": pa.array(items),
    })


def _columns(records: list) -> tuple[np.ndarray, np.ndarray]:
    """(vit_num, token_num) of ``records`` as int64 arrays (KeyError, TypeError or ValueError where one is bad)."""
    return (np.fromiter((r["vit_num"] for r in records), dtype=np.int64, count=len(records)),
            np.fromiter((r["token_num"] for r in records), dtype=np.int64, count=len(records)))


def _fields(path: Path, records: list) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_columns`, or an :class:`InputError` naming the first bad record."""
    try:
        return _columns(records)
    except (KeyError, TypeError, ValueError):
        bad = next(i for i, r in enumerate(records) if not (
            isinstance(r, dict) and isinstance(r.get("vit_num"), int) and isinstance(r.get("token_num"), int)))
        raise InputError(f"{path}: record {bad} is not {{'vit_num': int, 'token_num': int}}: {str(records[bad])[:80]}",
                         fix="fix or remove that record") from None


def _streamed_fields(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The fields of a JSON list read :data:`_CHUNK_BYTES` at a time and parsed up to the last
    record end read (``}`` then ``,``), so that only a chunk's records are Python objects at once:
    a 1.2M-record file (80 MB) took a process to 425 MiB parsed whole, to 133 MiB this way, in the
    same 0.8-1.0 s.

    Returns None where the file does not parse this way (an empty list, a record that is no
    flat ``{'vit_num': int, 'token_num': int}``, a ``},`` inside a string, invalid JSON): cutting
    inside a string or a nested object leaves the part before the cut invalid, so such a file
    never parses as different records; the caller then parses it whole, for its error.
    """
    items, llm = [], []
    with open(path, "rb") as handle:
        buf = handle.read(_CHUNK_BYTES).removeprefix(b"\xef\xbb\xbf").lstrip()
        if not buf.startswith(b"["):
            return None
        buf, cut = buf[1:], False
        while True:
            more = handle.read(_CHUNK_BYTES)
            if more:
                buf += more
                last = None
                for last in _RECORD_END.finditer(buf):
                    pass
                if last is None:  # no record ends in what was read: read on
                    continue
                part, buf, cut = buf[:last.start() + 1], buf[last.end():], True
            else:
                part = buf.rstrip()
                if not part.endswith(b"]") or (cut and not part[:-1].strip()):  # unclosed, or a comma before "]"
                    return None
                part = part[:-1]
            if part.strip():
                try:
                    columns = _columns(json.loads(b"[" + part + b"]"))
                except (ValueError, KeyError, TypeError):  # json.JSONDecodeError is a ValueError
                    return None
                items.append(columns[0])
                llm.append(columns[1])
            if not more:
                return (np.concatenate(items), np.concatenate(llm)) if items else None
