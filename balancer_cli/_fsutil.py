"""Small filesystem helpers shared by every writer: atomic outputs and content fingerprints.

Outputs appear only when complete: writers write to a temporary name in the same directory and
rename it into place, so an interrupted run never leaves a half-written table behind.

Example:
    >>> import pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_path(d / "x.txt") as tmp:
    ...     _ = tmp.write_text("hello")
    >>> (d / "x.txt").read_text()
    'hello'
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "file_fingerprint", "bytes_fingerprint"]

_CHUNK_BYTES = 1 << 20


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds.

    The parent directory is created if needed. On any exception the temporary file is removed and
    ``path`` is left untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    # mkstemp creates 0600 files; outputs are shared with training jobs that may run as another
    # user, so give them the permissions a plain open() would (0666 minus the umask).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_name, 0o666 & ~umask)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def file_fingerprint(path: str | os.PathLike) -> str:
    """Content fingerprint of a file: ``blake2b-128`` of its bytes, as hex.

    Streams the file in 1 MiB chunks, so memory does not grow with its size.
    """
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def bytes_fingerprint(*parts: bytes) -> str:
    """``blake2b-128`` hex digest of several byte strings, each length-prefixed (no ambiguity)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()
