"""Tar members addressed by byte offset: a read-only window over one member, and a cheap check
that a member still lies where a scan found it.

A scan of WebDataset shards (:mod:`~balancer_cli.scan.webdataset`) never extracts: each media
member is a :class:`MemberRef` (shard, data offset, size, name), opened as a :class:`TarWindow`,
a seekable binary stream over ``os.pread`` that the header readers
(:func:`~balancer_cli.scan.image_header.read_image_size`,
:func:`~balancer_cli.scan.media_header.read_video_info`, ``read_audio_info``) read like a file:
they read a few header bytes, never the member's whole body. The runtime
(:mod:`balancer_cli.runtime.shards`) reads members by the same offsets and checks them with
:func:`member_header_problem` first.

Example:
    >>> import io, pathlib, tarfile, tempfile
    >>> shard = pathlib.Path(tempfile.mkdtemp()) / "s.tar"
    >>> with tarfile.open(shard, "w") as tar:
    ...     info = tarfile.TarInfo("k.txt"); info.size = 5
    ...     tar.addfile(info, io.BytesIO(b"hello"))
    >>> with TarWindow(MemberRef(str(shard), 512, 5, "k.txt")) as window:
    ...     window.seek(1), window.read(3), window.seek(0, io.SEEK_END)
    (1, b'ell', 5)
    >>> member_header_problem(shard.read_bytes()[:512], "k.txt", 5) is None
    True
"""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass

__all__ = ["MemberRef", "TarWindow", "member_header_problem"]

_BLOCK = tarfile.BLOCKSIZE
#: Sizes from this one up need a PAX ``size`` record: the ustar field cannot hold them.
_PAX_SIZE = 8 ** 11


@dataclass(frozen=True)
class MemberRef:
    """Where one tar member's bytes are: ``size`` bytes at ``offset`` of ``shard``; ``name`` is the
    member's name (``key.ext``) for messages."""

    shard: str
    offset: int
    size: int
    name: str

    def __str__(self) -> str:
        return f"{self.shard}:{self.name}"


class TarWindow(io.RawIOBase):
    """A read-only, seekable binary stream over one tar member (``os.pread`` at the member's offset).

    Reads past the member's end return nothing, as at the end of a file; the shard is opened
    when the window is made and closed by :meth:`close` (or the ``with`` block).

    Args:
        ref: the member.
        fd: an open descriptor of ``ref.shard`` to read through instead (not closed here).
    """

    def __init__(self, ref: MemberRef, fd: int | None = None) -> None:
        super().__init__()
        self.ref = ref
        self.name = ref.name
        self._own = fd is None
        self._fd = os.open(ref.shard, os.O_RDONLY) if fd is None else fd
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.ref.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), max(0, self.ref.size - self._pos))
        if want == 0:
            return 0
        data = os.pread(self._fd, want, self.ref.offset + self._pos)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        want = max(0, self.ref.size - self._pos) if size is None or size < 0 else \
            min(size, max(0, self.ref.size - self._pos))
        if want == 0:
            return b""
        data = os.pread(self._fd, want, self.ref.offset + self._pos)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        if not self.closed and self._own:
            os.close(self._fd)
        super().close()


def member_header_problem(header: bytes, name: str, size: int) -> str | None:
    """Why the 512-byte tar header just before a member's data is not that member's, or None.

    ``header`` is read from ``offset - 512``; every tar writer puts the member's own ustar header
    there (GNU long-name and PAX records come before it). A short ASCII name must be the
    header's name (extensions compared case-insensitively, as the scan lower-cases them) and the
    size its size; a long or non-ASCII name sits in the record before, so only the header's
    checksum, type and (below 8 GiB) size are checked.

    Example:
        >>> member_header_problem(bytes(512), "k.txt", 5)
        'no tar header before the data (end of file header)'
    """
    if len(header) < _BLOCK:
        return "the shard ends before the member's header"
    try:
        info = tarfile.TarInfo.frombuf(header[:_BLOCK], "utf-8", "surrogateescape")
    except tarfile.HeaderError as exc:
        return f"no tar header before the data ({exc})"
    if not info.isreg():
        return f"the header before the data is not a regular file ({info.name!r})"
    short = name.isascii() and len(name.encode()) < tarfile.LENGTH_NAME
    if short and info.name.lower() != name.lower():
        return f"the header before the data names {info.name!r}"
    if size < _PAX_SIZE and info.size != size:
        return f"the header before the data gives {info.size:,} bytes, not {size:,}"
    return None
