"""Commit records: an output folder is complete only when its ``_COMMIT.json`` says so.

``balancer pack`` builds its whole output folder under a temporary sibling name
(``.OUT.tmp-HOST-PID-XXXX``), writes ``_COMMIT.json`` last (every file's size and ``blake2b-128``
checksum, plus the tool version), and only then renames the folder into place
(:func:`committed_folder`). A folder of a run that died is never seen under the output name; a
folder whose record is missing, or whose files differ from it, is refused by every reader
(:func:`verify_commit`, called by :func:`balancer_cli.manifest.open_manifest`).

What readers verify:

- ``quick`` (the sampler, planners: every training process): the record parses, every data
  file (``manifest.parquet``, ``dropped.parquet``) has its recorded size, and data files up to
  :data:`SMALL_BYTES` have their recorded checksum.
- ``full`` (``balancer report``, which reads every row anyway): every data file's checksum.

Report files (``report.*``) are listed but derived: ``balancer report`` regenerates them and then
rewrites the record, and readers do not require them to match.

Example:
    >>> import pathlib, tempfile
    >>> parent = pathlib.Path(tempfile.mkdtemp())
    >>> with committed_folder(parent / "out") as tmp:
    ...     _ = (tmp / "manifest.parquet").write_bytes(b"rows")
    >>> sorted(read_commit(parent / "out")["files"]), sorted(p.name for p in parent.iterdir())
    (['manifest.parquet'], ['out'])
    >>> verify_commit(parent / "out", names=["manifest.parquet"], full=True)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from balancer_cli import __version__
from balancer_cli._fsutil import (
    atomic_path,
    check_regular,
    create_new,
    dead_temporary_of,
    file_fingerprint,
    remove_dead_temporaries,
    temporary_sibling,
)
from balancer_cli._signals import mark_output_committed
from balancer_cli.errors import InputError, ManifestError

__all__ = ["COMMIT_FILE", "SMALL_BYTES", "write_commit", "read_commit", "verify_commit", "committed_folder",
           "check_replaceable"]

COMMIT_FILE = "_COMMIT.json"
#: Files up to this size are checksummed on every quick verification (cheap: a few ms).
SMALL_BYTES = 8 << 20
_FORMAT = "balancer-commit"
_VERSION = 1
_FIX = "re-run `balancer pack` to write this folder again"


def write_commit(folder: str | os.PathLike, names: Sequence[str] | None = None) -> Path:
    """Write ``folder/_COMMIT.json`` (atomically) listing ``names`` (default: every plain file).

    Hidden names (temporary files) are never listed.
    """
    folder = Path(folder)
    if names is None:
        names = sorted(p.name for p in folder.iterdir()
                       if p.is_file() and p.name != COMMIT_FILE and not p.name.startswith("."))
    files = {name: {"size": (folder / name).stat().st_size, "blake2b": file_fingerprint(folder / name)}
             for name in names}
    record = {"format": _FORMAT, "version": _VERSION, "tool_version": __version__, "files": files}
    with atomic_path(folder / COMMIT_FILE) as tmp:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return folder / COMMIT_FILE


def read_commit(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's commit record, or None if it has none (or it is not one of ours)."""
    try:
        record = json.loads((Path(folder) / COMMIT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != _FORMAT or not isinstance(record.get("files"), dict):
        return None
    return record


def verify_commit(folder: str | os.PathLike, *, names: Sequence[str], full: bool = False) -> None:
    """Raise :class:`ManifestError` unless ``folder``'s record lists ``names`` and they match it.

    Args:
        folder: the output folder.
        names: the files the caller reads (each must be listed and match).
        full: checksum every one (else only those up to :data:`SMALL_BYTES`; sizes always).
    """
    folder = Path(folder)
    record = read_commit(folder)
    if record is None:
        raise ManifestError(f"{folder}: no valid {COMMIT_FILE}; the run that wrote it did not finish, "
                            "or it was written by an older balancer_cli", fix=_FIX)
    if record.get("version") != _VERSION:
        raise ManifestError(f"{folder}: {COMMIT_FILE} is of version {record.get('version')!r}, this balancer_cli "
                            f"reads version {_VERSION}", fix="read it with the balancer_cli that wrote it, or " + _FIX)
    for name in names:
        entry = record["files"].get(name)
        path = folder / name
        if not isinstance(entry, dict):
            raise ManifestError(f"{folder}: {name} is not listed in {COMMIT_FILE}", fix=_FIX)
        if not (type(entry.get("size")) is int and isinstance(entry.get("blake2b"), str)):
            raise ManifestError(f"{folder}: {COMMIT_FILE}'s entry of {name} is malformed (size "
                                f"{entry.get('size')!r}, checksum {str(entry.get('blake2b'))[:40]!r})", fix=_FIX)
        try:
            size = path.stat().st_size
        except OSError:
            raise ManifestError(f"{folder}: {name} is missing (listed in {COMMIT_FILE})", fix=_FIX) from None
        if size != entry.get("size"):
            raise ManifestError(f"{folder}: {name} has {size} bytes, {COMMIT_FILE} records {entry.get('size')}; "
                                "it was changed after it was written", fix=_FIX)
        if (full or size <= SMALL_BYTES) and file_fingerprint(path) != entry.get("blake2b"):
            raise ManifestError(f"{folder}: {name} does not match its checksum in {COMMIT_FILE}; "
                                "it was changed after it was written", fix=_FIX)


#: The folder the replay keeps its per-world-size plans in, beside a committed manifest
#: (:mod:`balancer_cli.replay.plan_cache`): written by us after the commit, so not listed in the
#: record, and replaced with the folder (its plans belong to the manifest they were made for).
PLANS_DIR = "elastic-plans"


def _is_plans_dir(path: Path) -> bool:
    """Whether ``path`` is the replay's plans folder holding only plan files (``R<n>-...``) and temporaries."""
    return path.name == PLANS_DIR and path.is_dir() and not path.is_symlink() and all(
        entry.name.startswith(("R", ".")) and entry.is_file() and not entry.is_symlink() for entry in path.iterdir())


def check_replaceable(out: str | os.PathLike) -> None:
    """Raise :class:`InputError` unless ``out`` is absent, an empty folder, or a committed folder
    holding only the files its record lists, the replay's plans and temporaries of those files that
    a killed run left (so replacing it deletes nothing we did not write)."""
    out = Path(out)
    check_regular(out, folder=True)
    if not out.exists():
        return
    present = {p.name for p in out.iterdir()}
    if not present:
        return
    record = read_commit(out)
    fix = "choose another output folder, or move that one away"
    if record is None:
        raise InputError(f"output folder {out} is not empty and was not written by balancer (no {COMMIT_FILE})",
                         fix=fix)
    listed = set(record["files"]) | {COMMIT_FILE}
    # A killed `balancer report OUT` leaves its file's temporary inside: ours, replaced with the folder.
    foreign = sorted(name for name in present - listed
                     if not _is_plans_dir(out / name)
                     and not any(dead_temporary_of(out / name, out / f, folder=False) for f in listed))
    if foreign:
        raise InputError(f"output folder {out} holds files balancer did not write ({', '.join(foreign[:3])})",
                         fix=fix)


@contextlib.contextmanager
def committed_folder(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``out``; on success write its record and move it to ``out``.

    Temporary folders that killed runs into ``out`` left behind are removed first
    (:func:`~balancer_cli._fsutil.remove_dead_temporaries`).

    An existing ``out`` must pass :func:`check_replaceable`; the two folders are swapped in one
    atomic step (Linux ``renameat2``; elsewhere the old one is renamed away, the new one renamed
    in, and a crash in between leaves the old one as ``.OUT.old-XXXX/OUT``, never a mix), then
    the old one is deleted. On any exception (``KeyboardInterrupt`` and
    ``SystemExit`` from SIGTERM included) the temporary folder is removed and ``out`` is untouched.
    Once ``out`` is in place, a command's SIGTERM and Ctrl-C are held until it ends
    (:func:`balancer_cli._signals.mark_output_committed`).
    """
    out = Path(out)
    if out.is_symlink():  # replace the folder it points to; the link itself stays as the user made it
        out = Path(os.path.realpath(out))
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(out, folder=True)
    tmp = temporary_sibling(out, out.parent, folder=True)
    try:  # named before it exists, so a SIGTERM at any point finds the cleanup below armed
        create_new(tmp, folder=True)
        yield tmp
        write_commit(tmp)
        check_replaceable(out)  # again: something may have appeared while we worked
        with _signals_held():  # a SIGTERM between the renames must not leave neither folder in place
            if not out.exists():
                os.rename(tmp, out)
            elif not _exchange(tmp, out):
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.rename(out, old / out.name)
                try:
                    os.rename(tmp, out)
                except OSError:
                    os.rename(old / out.name, out)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            mark_output_committed()  # before the held signals are delivered: they find the output in place
    finally:
        with _signals_held():
            if tmp.exists():  # this run's folder, or after an exchange the previous output
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Defer SIGTERM and SIGINT (delivered when the block ends) in the main thread."""
    held = {signal.SIGTERM, signal.SIGINT}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: this kernel or filesystem cannot swap
        return False
    raise OSError(errno, os.strerror(errno), str(b))
