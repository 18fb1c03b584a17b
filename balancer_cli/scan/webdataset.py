"""WebDataset tar shards: the shard index (headers only), its samples as WebDataset groups them,
and the records a scan measures.

A shard is read header to header with :mod:`tarfile` (ustar, GNU long names and PAX headers),
seeking over every member's data, so indexing a 10 GB shard reads a few kilobytes per thousand
members. Members group into samples exactly as WebDataset's ``group_by_keys`` does:

- the key is the member name up to the first dot of its base name, the extension the rest,
  lower-cased (``base_plus_ext``: ``dir/abc.0.JPG`` -> ``dir/abc``, ``0.jpg``); a name without
  such a dot is skipped;
- consecutive members with one key form one sample; a key that comes back later starts a new
  sample, and a sample never spans two shards;
- members that are not regular files, and ``__meta__``-style names (``__*__`` at the top level,
  or a ``__*__/`` folder) are skipped;
- an extension twice in one sample is that sample's error (WebDataset raises).

The record is the ``json`` member, else the ``txt`` member as ``{"text": ...}``; image, video
and audio members (by their last extension, see :data:`MEDIA_EXTENSIONS`) become the record's
``images``/``videos``/``audios`` in natural extension order (``2.jpg`` before ``10.jpg``), read in place through
:class:`~balancer_cli.scan.tar_window.TarWindow` s. Size fields of the record win, as for
JSONL records. Compressed shards are refused: offsets must address the raw tar.

Example:
    >>> import io, json, pathlib, tarfile, tempfile
    >>> shard = pathlib.Path(tempfile.mkdtemp()) / "s.tar"
    >>> with tarfile.open(shard, "w") as tar:
    ...     for name, data in [("a.json", json.dumps({"text": "hi"}).encode()), ("a.cls", b"1"), ("b.txt", b"yo")]:
    ...         info = tarfile.TarInfo(name); info.size = len(data); tar.addfile(info, io.BytesIO(data))
    >>> [(s.key, s.names) for s in iter_tar_samples(str(shard))]
    [('a', ('json', 'cls')), ('b', ('txt',))]
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from balancer_cli.errors import InputError
from balancer_cli.scan.records import BadRecord, decode_record
from balancer_cli.scan.tar_window import MemberRef

__all__ = ["COMPRESSED_MAGIC", "MEDIA_EXTENSIONS", "TarSample", "base_plus_ext", "check_uncompressed",
           "group_members", "is_tar", "iter_tar_members", "iter_tar_samples", "media_kind", "natural_key",
           "sample_record", "shard_files"]

#: Media kind of each member extension (its last dot-separated part, lower-cased).
MEDIA_EXTENSIONS = {**dict.fromkeys(("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"), "image"),
                    **dict.fromkeys(("mp4", "mov", "mkv", "webm", "avi"), "video"),
                    **dict.fromkeys(("wav", "flac", "mp3", "ogg", "m4a"), "audio")}
#: Leading bytes of compressed files (gzip, bzip2, xz, zstd): a shard must be a raw tar.
COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".tzst")
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")
_BLOCK = tarfile.BLOCKSIZE
_DIGITS = re.compile(r"(\d+)")


def base_plus_ext(name: str) -> tuple[str | None, str | None]:
    """``(key, extension)`` of a member name as WebDataset splits it (``(None, None)``: no key).

    Example:
        >>> base_plus_ext("dir/abc.0.jpg"), base_plus_ext("dir.x/readme")
        (('dir/abc', '0.jpg'), (None, None))
    """
    match = _KEY.match(name)
    return (match.group(1), match.group(2)) if match else (None, None)


def natural_key(ext: str) -> tuple:
    """Sort key of member extensions with their numbers compared as numbers.

    Example:
        >>> sorted(["10.jpg", "2.jpg", "1.png", "jpg"], key=natural_key)
        ['1.png', '2.jpg', '10.jpg', 'jpg']
    """
    return tuple((0, int(part), part) if part.isdigit() else (1, 0, part) for part in _DIGITS.split(ext) if part)


def media_kind(ext: str) -> str | None:
    """``image``/``video``/``audio`` for a member extension (by its last part), else None.

    Example:
        >>> media_kind("0.jpg"), media_kind("json")
        ('image', None)
    """
    return MEDIA_EXTENSIONS.get(ext.rsplit(".", 1)[-1])


def _compression(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(_COMPRESSED_SUFFIXES):
        return lower.rsplit(".", 1)[-1]
    try:
        with open(path, "rb") as handle:
            head = handle.read(6)
    except OSError:
        return None
    return next((name for magic, name in COMPRESSED_MAGIC.items() if head.startswith(magic)), None)


def check_uncompressed(path: str) -> None:
    """Raise the InputError of a compressed shard (by its name or its bytes).

    Example:
        >>> check_uncompressed("shards/000.tar.gz")
        Traceback (most recent call last):
        ...
        balancer_cli.errors.InputError: shards/000.tar.gz: a compressed tar shard (gz); fix: decompress it (e.g. `gunzip`): the lengths table addresses members by their offsets in the raw tar
    """
    kind = _compression(path)
    if kind is not None:
        raise InputError(f"{path}: a compressed tar shard ({kind})",
                         fix="decompress it (e.g. `gunzip`): the lengths table addresses members by their "
                             "offsets in the raw tar")


def is_tar(path: str, head: bytes) -> bool:
    """Whether a file is a tar shard (``head``: its first bytes): a ``.tar`` name (then an
    unreadable header is the shard's own error), or a valid tar header first.

    Raises:
        InputError: a compressed tar (``.tar.gz``, ``.tgz``, ... or a ``.tar`` of gzip bytes).

    Example:
        >>> is_tar("x.bin", bytes(600)), is_tar("x.tar", b"")
        (False, True)
    """
    lower = path.lower()
    if lower.endswith(_COMPRESSED_SUFFIXES) or lower.endswith(".tar"):
        check_uncompressed(path)
        return True
    try:
        tarfile.TarInfo.frombuf(head[:_BLOCK], "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def shard_files(folder: str) -> list[str]:
    """The ``*.tar`` shards of a folder, sorted by name (compressed shards refused); [] if none.

    Example:
        >>> import tempfile
        >>> shard_files(tempfile.mkdtemp())
        []
    """
    names = sorted(entry.name for entry in os.scandir(folder) if entry.is_file())
    shards = [os.path.join(folder, name) for name in names if name.lower().endswith((".tar", *_COMPRESSED_SUFFIXES))]
    for shard in shards:
        check_uncompressed(shard)  # by name, or by its first bytes
    return shards


@dataclass(frozen=True)
class TarSample:
    """One sample of a shard: its key, its members' extensions, data offsets and sizes, and the
    error that keeps it from being measured (a truncated member, a duplicate extension)."""

    key: str
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    error: str | None = None
    error_kind: str = "malformed_record"
    start: int = 0  # header offset of its first member
    stop: int = 0   # end of its last member's data


#: One member of the index: ``(name, header_offset, data_offset, size, is_regular, problem)``.
Member = tuple[str, int, int, int, bool, "str | None"]


def iter_tar_members(path: str) -> Iterator[Member]:
    """Every member of a shard, header by header (bodies are skipped, never read).

    A member whose data runs past the end of the file, or a broken header after the first, is
    the last member yielded, with its ``problem`` text (the shard cannot be read further).

    Raises:
        InputError: a compressed shard, or a file that does not start with a tar header.
    """
    check_uncompressed(path)
    size = os.stat(path).st_size
    with open(path, "rb") as handle:
        try:
            tar = tarfile.TarFile(fileobj=handle, mode="r", encoding="utf-8", errors="surrogateescape")
        except tarfile.TarError as exc:
            raise InputError(f"{path}: not a tar file ({exc})",
                             fix="pass uncompressed WebDataset .tar shards") from None
        member, tar.firstmember = tar.firstmember, None  # (else next() returns it again)
        while member is not None:
            end = member.offset_data + (member.size if member.isreg() else 0)
            problem = None
            if member.isreg() and end > size:
                problem = (f"the shard is truncated: member {member.name!r} ({member.size:,} bytes at byte "
                           f"{member.offset_data:,}) runs past its end ({size:,} bytes)")
            elif member.issparse():
                problem = f"member {member.name!r} is a sparse file, whose bytes are not in one piece"
            yield member.name, member.offset, member.offset_data, member.size, member.isreg(), problem
            if problem is not None and end > size:
                return
            tar.members = []  # an index, not an archive listing: constant memory
            handle.seek(tar.offset)  # (tarfile would read the last byte of the body to check it)
            try:
                member = tar.next()
            except tarfile.TarError as exc:
                member = None
                cut = str(exc)
            else:
                cut = None
            if member is None:
                cut = cut or _end_problem(handle, tar.offset, size)
                if cut is not None:
                    yield "", tar.offset, tar.offset, 0, False, f"unreadable tar data at byte {tar.offset:,} ({cut})"


def _end_problem(handle: Any, offset: int, size: int) -> str | None:
    """Why the archive ended at ``offset`` when it did not end with zero blocks, else None."""
    if offset >= size:
        return None
    handle.seek(offset)
    block = handle.read(_BLOCK)
    if len(block) < _BLOCK:
        return "the shard ends inside a header" if block.strip(b"\0") else None
    return None if not block.strip(b"\0") else "not a tar header: the rest of the shard is unreadable"


def _skipped(name: str, regular: bool) -> bool:
    if not regular or not name:
        return True
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return True
    return _META.match(name) is not None


def group_members(members: Iterable[Member]) -> Iterator[TarSample]:
    """Group one shard's members into samples as WebDataset's ``group_by_keys`` does (see the
    module docstring); a member's ``problem`` makes its sample (or the last one) an error.

    Example:
        >>> members = [("a.jpg", 0, 512, 3, True, None), ("a.JSON", 1024, 1536, 2, True, None),
        ...            ("b.txt", 2048, 2560, 1, True, None), ("a.txt", 3072, 3584, 1, True, None)]
        >>> [(s.key, s.names, s.offsets) for s in group_members(members)]
        [('a', ('jpg', 'json'), (512, 1536)), ('b', ('txt',), (2560,)), ('a', ('txt',), (3584,))]
    """
    current: dict[str, Any] | None = None
    for name, header, data, size, regular, problem in members:
        key, ext = (None, None) if _skipped(name, regular) else base_plus_ext(name)
        if key is None:
            if problem is not None and current is not None:  # the shard is cut after this sample's members
                _fail(current, problem, "malformed_record")
            continue
        ext = ext.lower()
        if current is None or key != current["key"]:
            if current is not None:
                yield _sample(current)
            current = {"key": key, "names": [], "offsets": [], "sizes": [], "error": None,
                       "error_kind": "malformed_record", "start": header}
        if ext in current["names"]:
            _fail(current, f"member {name!r}: extension {ext!r} twice in one sample", "malformed_record")
        current["names"].append(ext)
        current["offsets"].append(data)
        current["sizes"].append(size)
        current["stop"] = data + size
        if problem is not None:
            kind = media_kind(ext)
            _fail(current, problem, f"corrupt_{kind}" if kind else "malformed_record")
    if current is not None:
        yield _sample(current)


def _fail(current: dict[str, Any], problem: str, kind: str) -> None:
    if current["error"] is None:  # the first problem names the sample's error
        current["error"], current["error_kind"] = problem, kind


def _sample(current: dict[str, Any]) -> TarSample:
    return TarSample(current["key"], tuple(current["names"]), tuple(current["offsets"]), tuple(current["sizes"]),
                     current["error"], current["error_kind"], current["start"], current["stop"])


def iter_tar_samples(path: str) -> Iterator[TarSample]:
    """The samples of one shard, in order (headers only; constant memory).

    Raises:
        InputError: a compressed shard or a file that is not a tar.
    """
    return group_members(iter_tar_members(path))


def _read_member(fd: int, ref: MemberRef) -> bytes:
    data = os.pread(fd, ref.size, ref.offset)
    if len(data) != ref.size:
        raise OSError(f"{ref.name}: {len(data)} of {ref.size} bytes (the shard changed since it was indexed)")
    return data


def sample_record(shard: str, sample: TarSample, fd: int, fields: Mapping[str, str]) -> Any:
    """The record of one sample: its ``json`` (or ``txt``) member with its media members attached
    as :class:`~balancer_cli.scan.tar_window.MemberRef` s; a :class:`~balancer_cli.scan.records.BadRecord`
    when it cannot be one."""
    if sample.error is not None:
        return BadRecord(sample.error, sample.error_kind)
    members = {ext: MemberRef(shard, offset, size, f"{sample.key}.{ext}")
               for ext, offset, size in zip(sample.names, sample.offsets, sample.sizes)}
    try:
        if "json" in members:
            record = decode_record(_read_member(fd, members["json"]), f"member {sample.key}.json")
            if isinstance(record, BadRecord):
                return record
            if not isinstance(record, dict):
                return BadRecord(f"member {sample.key}.json is a JSON {type(record).__name__}, expected an object")
        elif "txt" in members:
            record = {fields.get("text", "text"): _read_member(fd, members["txt"]).decode("utf-8")}
        else:
            return BadRecord(f"sample {sample.key!r} has no json or txt member (members: {', '.join(sample.names)})",
                             fix=f"add {sample.key}.json (the record) or {sample.key}.txt (its text) to the shard")
    except UnicodeDecodeError as exc:
        return BadRecord(f"member {sample.key}.txt is not UTF-8 ({exc.reason})")
    except OSError as exc:
        return BadRecord(f"unreadable member of {shard} ({exc})", "unreadable_file")
    for kind in ("image", "video", "audio"):
        refs = [members[ext] for ext in sorted(members, key=natural_key) if media_kind(ext) == kind]
        if refs:
            _attach(record, kind, refs, fields)
    return record


def _attach(record: dict[str, Any], kind: str, refs: list[MemberRef], fields: Mapping[str, str]) -> None:
    """Make the members the record's ``<kind>s``; per-item dicts of the same count keep their
    size fields (the record's sizes win over the headers)."""
    one, many = fields.get(kind, kind), fields.get(kind + "s", kind + "s")
    listed = record.pop(one, None)
    listed = record.pop(many, None) if listed is None else listed
    listed = listed if isinstance(listed, list) else [listed] if listed is not None else []
    if len(listed) == len(refs) and all(isinstance(item, Mapping) for item in listed):
        record[many] = [{**{k: v for k, v in item.items() if k != "bytes"}, "path": ref}
                        for item, ref in zip(listed, refs)]
    else:
        record[many] = refs

