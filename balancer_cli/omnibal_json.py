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
from pathlib import Path

import numpy as np
import pyarrow as pa

from balancer_cli.errors import InputError

__all__ = ["read_omnibal_json", "TOKENS_PER_TILE"]

#: InternVL's vision tokens per 448 px tile (after pixel shuffle).
TOKENS_PER_TILE = 256
_FIX = "pass a lengths Parquet file or an OmniBal token-length JSON list"


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
        records = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read token-length JSON ({exc})", fix=_FIX) from None
    if not isinstance(records, list) or not records:
        raise InputError(f"{path}: expected a non-empty JSON list of {{'vit_num', 'token_num'}} records", fix=_FIX)
    try:
        items = np.fromiter((r["vit_num"] for r in records), dtype=np.int64, count=len(records))
        llm = np.fromiter((r["token_num"] for r in records), dtype=np.int64, count=len(records))
    except (KeyError, TypeError, ValueError):
        bad = next(i for i, r in enumerate(records) if not (
            isinstance(r, dict) and isinstance(r.get("vit_num"), int) and isinstance(r.get("token_num"), int)))
        raise InputError(f"{path}: record {bad} is not {{'vit_num': int, 'token_num': int}}: {str(records[bad])[:80]}",
                         fix="fix or remove that record") from None
    return pa.table({
        "source": pa.array([path.stem] * len(records)).dictionary_encode(),
        "llm_tokens": pa.array(llm),
        "vision_tokens": pa.array(items * TOKENS_PER_TILE),
        "vision_items": pa.array(items),
    })
