"""The inputs of ``balancer scan``: format detection and the expansion of meta files into :class:`InputSpec` s.

Formats (:func:`detect_format` reads the content, not the name; ``format=`` forces one):

- ``jsonl``: one JSON object per line; blank lines are skipped (they are not samples).
- ``json``: a JSON list of records (decoded incrementally; the main process parses the list once to
  find record boundaries, so a syntax error anywhere makes the whole file unreadable).
- ``internvl-meta``: InternVL's meta JSON ``{name: {"root", "annotation", "repeat_time", ...}}``:
  each dataset's annotation file is scanned with ``root`` as its image root and the dataset name as
  its source, ``repeat_time`` times as InternVL's loader applies it (a fraction below 1 keeps the
  first ``int(n * repeat_time)`` records, possibly none; above 1 it must be an integer);
  a per-dataset ``max_dynamic_patch`` overrides the rule's ``max_tiles`` for that dataset.
- ``parquet``: rows of a Parquet file (only the columns the scan understands are read).
- ``hf``: a ``datasets.Dataset.save_to_disk`` folder (a ``DatasetDict`` folder takes ``split``,
  default ``train``), or a ``datasets`` cache ``.arrow`` file (what ``load_dataset`` over local
  files writes).
- ``webdataset``: a WebDataset ``.tar`` shard (:mod:`~balancer_cli.scan.webdataset`), or a folder
  of them: its ``*.tar`` files, sorted by name, each an input whose source is the folder's name
  (other files in the folder are ignored), or a pattern of them: WebDataset's brace notation
  ``shard-{000000..000099}.tar`` or a glob, when the shell did not expand it
  (:mod:`~balancer_cli.scan.patterns`). Compressed shards (``.tar.gz``, ``.tgz``, gzip bytes)
  are refused: the lengths table addresses members by their offsets in the raw tar.

Example:
    >>> import json, pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"text": "a"}) + "\\n")
    >>> [(s.format, s.source) for s in expand_inputs([str(p)])]
    [('jsonl', 'd.jsonl')]
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.hf_datasets import check_builder_input
from balancer_cli.scan.patterns import expand_pattern, is_pattern
from balancer_cli.scan.webdataset import is_tar, shard_files

__all__ = ["FORMATS", "MAX_DYNAMIC_PATCH", "RECORD_FORMATS", "InputSpec", "detect_format", "expand_inputs", "open_input"]

#: Formats ``format=`` (``--format``) accepts, in the order error messages list them.
FORMATS = ("jsonl", "json", "internvl-meta", "parquet", "hf", "webdataset")
#: Formats that hold records: a meta file lists other inputs, which are read in their own format.
RECORD_FORMATS = tuple(name for name in FORMATS if name != "internvl-meta")
#: Leading bytes -> format, checked before the name (a Parquet file is Parquet whatever its name).
_MAGIC = {b"PAR1": "parquet"}
#: File suffix -> format, for files whose first bytes do not say (Arrow IPC streams).
_SUFFIXES = {".arrow": "hf"}
_WHITESPACE = " \t\r\n"
#: Bytes :func:`detect_format` reads, and the lines of them it tries as records past the first.
_HEAD_BYTES = 1 << 16
_PROBE_LINES = 9
#: Names of JSON lines files: where the content is one broken line, the name decides.
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
#: The largest InternVL ``max_dynamic_patch`` accepted (InternVL's own configs use 6..48 tiles).
MAX_DYNAMIC_PATCH = 1024


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One concrete input after expanding meta files: what to read and how to name its samples.

    Attributes:
        path: the file, folder or (with ``builder``) glob as given.
        format: one of :data:`RECORD_FORMATS`.
        source: the ``source`` column value of its samples.
        image_root: folder relative image paths resolve against (and may not escape).
        repeat: InternVL ``repeat_time`` (a fraction below 1 keeps the first records).
        rule_overrides: vision-rule parameters for this input only (InternVL meta).
        split: the ``DatasetDict`` split (``hf`` only).
        builder: the ``datasets.load_dataset`` builder of ``path`` (``hf`` over local files only).
    """

    path: str
    format: str
    source: str
    image_root: str
    repeat: float = 1.0
    rule_overrides: tuple[tuple[str, Any], ...] = ()
    split: str | None = None
    builder: str | None = None

    def __post_init__(self) -> None:
        if self.format not in RECORD_FORMATS:
            raise ValueError(f"InputSpec.format {self.format!r} is not one of {RECORD_FORMATS}")
        if not self.repeat > 0:
            raise ValueError(f"InputSpec.repeat {self.repeat!r} must be positive")


def open_input(path: str, *, text: bool = False) -> IO:
    """Open an input file for reading (UTF-8 text or bytes), or raise the InputError that names it.

    Example:
        >>> open_input("/no/such/file.jsonl")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        balancer_cli.errors.InputError: /no/such/file.jsonl: cannot read input (No such file or directory); fix: ...
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open; a device never ends
            raise InputError(f"{path}: not a regular file", fix="pass the dataset file itself")
        return open(path, encoding="utf-8") if text else open(path, "rb")
    except ValueError:  # a NUL byte in the path
        raise InputError(f"{path!r}: not a valid path", fix="check the path") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read input ({exc.strerror or exc})",
                         fix="check the path and its permissions") from None


def detect_format(path: str) -> str:
    """Detect an input's format from its content (not its name); raises InputError if unknown.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
        >>> _ = p.write_text('[{"text": "hi"}]')
        >>> detect_format(str(p))
        'json'
    """
    target = Path(path)
    if target.is_dir():
        if (target / "dataset_dict.json").is_file() or (target / "state.json").is_file():
            return "hf"
        if shard_files(path):  # refuses compressed shards
            return "webdataset"
        raise InputError(f"{path}: a folder that is not a `datasets` save_to_disk folder and holds no .tar shards",
                         fix="pass the data files themselves (JSONL, JSON, Parquet), a save_to_disk folder, "
                             "or a folder of WebDataset .tar shards")
    if not target.exists():
        raise InputError(f"{path}: no such file", fix="check the path")
    with open_input(path) as handle:
        head = handle.read(_HEAD_BYTES)
    for magic, name in _MAGIC.items():
        if head.startswith(magic):
            return name
    if is_tar(path, head):  # refuses compressed shards
        return "webdataset"
    if target.suffix in _SUFFIXES:
        return _SUFFIXES[target.suffix]
    text = head.decode("utf-8", errors="replace").lstrip(_WHITESPACE + "\ufeff")
    if not text:
        raise InputError(f"{path}: the input file is empty", fix="pass a file with at least one record")
    # Whole lines only: the head may end inside one (a file of 64 KiB or more).
    lines = [line for line in text.split("\n")[: None if len(head) < _HEAD_BYTES else -1] if line.strip(_WHITESPACE)]
    first_ok, first = _line_value(lines[0]) if lines else (False, None)
    # A line of its own that parses, then more lines: JSON lines whose first record is that line
    # (a list there is that record's error); a JSON list or object spans its lines or ends the file.
    if text[0] == "[":
        return "jsonl" if first_ok and len(lines) > 1 else "json"
    if text[0] == "{" and first_ok:
        return "internvl-meta" if _is_meta(first) else "jsonl"
    # The first line does not parse. Records on the next lines make it JSON lines whose first
    # record is broken (its own error, not the end of the scan); else a pretty-printed object
    # (only meta files are objects), or a .jsonl file of one broken line.
    if (any(isinstance(_line_value(line)[1], dict) for line in lines[1:_PROBE_LINES])
            or target.suffix.lower() in _JSONL_SUFFIXES):
        return "jsonl"
    if text[0] == "{":
        return "internvl-meta" if _is_meta(_load_small_json(target)) else "jsonl"
    raise InputError(f"{path}: cannot detect the input format (starts with {text[:20]!r})",
                     fix="pass JSONL, a JSON list, an InternVL meta JSON, Parquet, or a datasets folder "
                         "(or force one with --format " + "|".join(FORMATS) + ")")


def _line_value(line: str) -> tuple[bool, Any]:
    """``(parses, value)`` of one line as a JSON document (a line nested too deeply to decode counts
    as one: it is a record, its own error when read, as meta files are shallow)."""
    try:
        return True, json.loads(line)
    except RecursionError:
        return True, None
    except ValueError:  # JSONDecodeError, or a number of too many digits
        return False, None


def _load_small_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise InputError(f"{path}: a JSON document nested too deeply to read",
                         fix="fix the JSON, or write one record per line (JSONL)") from None
    except (OSError, ValueError) as exc:  # ValueError: UnicodeDecodeError, JSONDecodeError and kin
        raise InputError(f"{path}: neither JSONL nor a valid JSON document ({exc})",
                         fix="fix the JSON, or write one record per line (JSONL)") from None


def _is_meta(obj: Any) -> bool:
    return (isinstance(obj, dict) and bool(obj)
            and all(isinstance(v, dict) and "annotation" in v for v in obj.values()))


def _meta_inputs(path: str, image_root: str | None, split: str | None) -> list[InputSpec]:
    meta = _load_small_json(Path(path))
    if not _is_meta(meta):
        raise InputError(f"{path}: not an InternVL meta JSON ({{name: {{'root', 'annotation', ...}}}})",
                         fix="drop --format internvl-meta, or fix the file")
    base = Path(path).parent
    specs = []
    for name, entry in meta.items():
        annotation = _relative_to(str(entry["annotation"]), base)
        root = image_root or _relative_to(str(entry.get("root", "")), base)
        if not isinstance(entry["annotation"], str) or not isinstance(entry.get("root", ""), str):
            raise InputError(f"{path}: dataset {name!r} has a non-string 'annotation' or 'root'",
                             fix="give 'annotation' and 'root' as paths (strings)")
        repeat = entry.get("repeat_time", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or not math.isfinite(repeat) \
                or repeat <= 0:
            raise InputError(f"{path}: dataset {name!r} has repeat_time={repeat!r}",
                             fix="repeat_time must be a positive number")
        if isinstance(repeat, float) and repeat > 1:
            # InternVL's loader asserts isinstance(repeat_time, int) above 1: 2.0 stops its training.
            raise InputError(f"{path}: dataset {name!r} has repeat_time={repeat!r}, above 1 but not an integer",
                             fix="write an integer repeat_time above 1 (2, not 2.0), or a fraction below 1")
        overrides = ()
        if "max_dynamic_patch" in entry:
            patches = entry["max_dynamic_patch"]
            if isinstance(patches, bool) or not isinstance(patches, int) or not 1 <= patches <= MAX_DYNAMIC_PATCH:
                raise InputError(f"{path}: dataset {name!r} has max_dynamic_patch={patches!r}",
                                 fix=f"max_dynamic_patch must be an integer in 1..{MAX_DYNAMIC_PATCH}")
            overrides = (("max_tiles", patches),)
        fmt = detect_format(annotation)
        if fmt == "internvl-meta":
            raise InputError(f"{path}: dataset {name!r} points at another meta file", fix="flatten the meta file")
        paths = shard_files(annotation) if fmt == "webdataset" and Path(annotation).is_dir() else [annotation]
        specs += [InputSpec(path=one, format=fmt, source=str(name), image_root=root, repeat=float(repeat),
                            rule_overrides=overrides, split=split) for one in paths]
    return specs


def _relative_to(value: str, base: Path) -> str:
    # InternVL resolves meta paths against the working directory; fall back to the meta's folder.
    if not value or os.path.isabs(value) or os.path.exists(value):
        return value or "."
    return str(base / value)


def _builder_spec(path: str, builder: str, image_root: str | None, split: str | None) -> InputSpec:
    check_builder_input(path, builder)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    name = Path(path).name or str(folder)
    return InputSpec(path=path, format="hf", source=name, image_root=image_root or str(folder), split=split,
                     builder=builder)


def expand_inputs(paths: Sequence[str], *, image_root: str | None = None, format: str | None = None,
                  split: str | None = None, builder: str | None = None) -> list[InputSpec]:
    """Detect each input's format and expand meta files into their annotation files, in order.

    Relative image paths resolve against ``image_root``, else the InternVL ``root``, else the
    input file's folder. With ``builder`` (one of
    :data:`~balancer_cli.scan.hf_datasets.HF_BUILDERS`) every input is a local file, glob or folder
    loaded by ``datasets.load_dataset(builder, ...)``.

    Example:
        >>> expand_inputs([])
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: no input given; fix: pass one or more dataset files: balancer scan DATA.jsonl ...
    """
    if not paths:
        raise UsageError("no input given", fix="pass one or more dataset files: balancer scan DATA.jsonl ...")
    if format is not None and format not in FORMATS:
        raise UsageError(f"unknown --format {format!r}", fix="use one of: " + ", ".join(FORMATS))
    if builder is not None:
        if format is not None:
            raise UsageError("--format and --hf-builder cannot be combined",
                             fix="--hf-builder already says how to read the inputs; drop --format")
        return [_builder_spec(str(path), builder, image_root, split) for path in paths]
    specs: list[InputSpec] = []
    for given in paths:
        expanded = expand_pattern(str(given))
        pattern_source = _pattern_source(str(given)) if len(expanded) != 1 or expanded[0] != str(given) else None
        for path in expanded:
            specs += _specs(path, format, image_root, split, pattern_source)
    return specs


def _folder_source(folder: str) -> str:
    """The source of the shards of a folder: its name (``.``: the working directory's)."""
    return Path(folder).name or Path(folder or ".").resolve().name


def _pattern_source(pattern: str) -> str:
    """The source of the shards a pattern names: the name of the folder it lies in."""
    head = os.path.dirname(pattern)
    while head and is_pattern(os.path.basename(head)):
        head = os.path.dirname(head)
    return _folder_source(head)


def _specs(path: str, format: str | None, image_root: str | None, split: str | None,
           pattern_source: str | None) -> list[InputSpec]:
    """The input specs of one path (a meta file or a shard folder expands to several)."""
    if format is None:
        fmt = detect_format(path)  # raises for a missing path
    elif os.path.exists(path):
        fmt = format
        folder = Path(path).is_dir()
        if folder and fmt not in ("hf", "webdataset"):  # the others read one file
            raise InputError(f"{path}: a folder, and --format {fmt} reads a file", fix="pass the file, or drop --format")
        if not folder and fmt == "hf" and Path(path).suffix not in _SUFFIXES:
            raise InputError(f"{path}: a file, and --format hf reads a datasets save_to_disk folder or .arrow file",
                             fix="pass the folder, or drop --format")
    else:
        raise InputError(f"{path}: no such file", fix="check the path")
    if fmt == "internvl-meta":
        return _meta_inputs(path, image_root, split)
    if fmt == "webdataset" and Path(path).is_dir():
        shards = shard_files(path)
        if not shards:
            raise InputError(f"{path}: no .tar shards in the folder", fix="pass a folder of WebDataset .tar shards")
        return [InputSpec(path=shard, format=fmt, source=_folder_source(path), image_root=image_root or path,
                          split=split) for shard in shards]
    root = image_root or str(Path(path).parent if not Path(path).is_dir() else Path(path))
    # shards a pattern names share their folder's source, as those of a folder do
    source = pattern_source if fmt == "webdataset" and pattern_source else Path(path).name
    return [InputSpec(path=path, format=fmt, source=source, image_root=root, split=split)]
