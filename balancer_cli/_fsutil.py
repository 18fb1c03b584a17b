"""Small filesystem helpers shared by every writer: atomic outputs, output checks, work folders
and content fingerprints.

Outputs appear only when complete: writers write to a temporary name in the same directory and
rename it into place, so an interrupted run never leaves a half-written table behind (and the
next write of the same output deletes a temporary a killed run left). Before any
work, :func:`check_output` refuses an output that is (or holds, or lies inside) an input, or that is
not a regular file or folder (a FIFO, a device node, a socket, or a link to one): such a path is
never replaced. Work folders (the Ray ``OUT.parts/``) carry :data:`PARTS_MARKER`; a folder without
it was not made by balancer and is neither reused nor deleted.

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
import secrets
import shutil
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from balancer_cli.errors import InputError

__all__ = ["atomic_path", "file_fingerprint", "bytes_fingerprint", "check_output", "check_regular", "check_writable",
           "PARTS_MARKER", "claim_parts_dir", "remove_parts_dir", "temporary_prefix", "temporary_sibling",
           "create_new", "dead_temporary_of", "remove_dead_temporaries"]

#: The file that marks a work folder as created by balancer (so it may be reused and deleted).
PARTS_MARKER = ".balancer-parts"

_CHUNK_BYTES = 1 << 20


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds.

    The parent directory is created if needed. On any exception the temporary file is removed and
    ``path`` is left untouched; one that a killed run left is removed by the next write of ``path``
    (:func:`remove_dead_temporaries`).
    """
    target = Path(path)
    check_regular(target, folder=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(target, folder=False)
    tmp = temporary_sibling(target, target.parent, folder=False)
    try:  # named before it exists, so a SIGTERM at any point finds this cleanup armed
        create_new(tmp, folder=False)
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def temporary_sibling(target: str | os.PathLike, where: str | os.PathLike, *, folder: bool) -> Path:
    """A fresh temporary name for ``target`` in the folder ``where``: :func:`temporary_prefix`, this
    run's PID and 8 random hex digits (what :func:`dead_temporary_of` reads back), then ``.tmp``
    unless it names a ``folder``; nothing is created.

    Writers name their temporary first and create it inside the block whose ``finally`` removes
    it (:func:`create_new`): a temporary made by ``mkstemp`` exists before its name is held, and a
    SIGTERM that lands in between (the command raises there) left it behind.

    Example:
        >>> name = temporary_sibling("/data/out.parquet", "/data", folder=False).name
        >>> name.startswith(temporary_prefix("out.parquet") + f"{os.getpid()}-"), name.endswith(".tmp")
        (True, True)
    """
    suffix = "" if folder else ".tmp"
    return Path(where) / f"{temporary_prefix(target)}{os.getpid()}-{secrets.token_hex(4)}{suffix}"


def create_new(path: Path, *, folder: bool) -> None:
    """Create ``path`` (an empty file, or a ``folder``), failing if it exists, with the permissions
    a plain ``open()`` or ``mkdir`` gives (0666 or 0777 minus the umask): outputs are read by
    training jobs that may run as another user."""
    if folder:
        os.mkdir(path, 0o777)
    else:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))


def temporary_prefix(target: str | os.PathLike) -> str:
    """``.NAME.tmp-HOST-``: how runs that share this host's PIDs name their temporaries of ``target``
    (then the run's PID, a dash and a random part)."""
    return f".{Path(target).name}.tmp-{_host_tag()}-"


def _host_tag() -> str:
    """A hash of the host name and the PID namespace: two containers on one machine (even of one
    host name) see different PIDs, so neither may judge the other's temporaries by PID."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: the host name alone
        namespace = ""
    return hashlib.blake2b(f"{socket.gethostname()}|{namespace}".encode(), digest_size=4).hexdigest()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def dead_temporary_of(entry: os.DirEntry | Path, target: str | os.PathLike, *, folder: bool) -> bool:
    """Whether ``entry`` is a temporary of ``target`` that a killed run left (see
    :func:`remove_dead_temporaries`): named for this host by a process that is gone, and a plain
    file (``folder`` False) or a folder of plain files only."""
    prefix = temporary_prefix(target)
    name = entry.name
    pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
    if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
        return False
    path = os.fspath(entry.path if isinstance(entry, os.DirEntry) else entry)
    try:
        if not folder:
            return stat.S_ISREG(os.lstat(path).st_mode)
        return stat.S_ISDIR(os.lstat(path).st_mode) and all(e.is_file(follow_symlinks=False) for e in os.scandir(path))
    except OSError:
        return False


def remove_dead_temporaries(target: str | os.PathLike, *, folder: bool) -> list[Path]:
    """Delete the temporaries of ``target`` that runs left when killed (SIGKILL, a power cut).

    Only siblings named :func:`temporary_prefix` ``+ PID-...`` whose process ``PID`` no longer
    exists are removed, and only when they are what that run made: a plain file (``folder``
    False), or a folder holding plain files only. A live run's temporary, another host's or
    container's (a shared file system), an older version's (no PID in the name) and anything else
    are left alone.

    Returns:
        The paths removed.

    Example:
        >>> import pathlib, tempfile
        >>> parent = pathlib.Path(tempfile.mkdtemp())
        >>> dead = parent / (temporary_prefix(parent / "out") + "999999999-x")  # no such PID
        >>> dead.mkdir(); _ = (dead / "manifest.parquet").write_bytes(b"half")
        >>> [p.name == dead.name for p in remove_dead_temporaries(parent / "out", folder=True)], dead.exists()
        ([True], False)
    """
    target = Path(target)
    removed = []
    try:
        siblings = list(os.scandir(target.parent))
    except OSError:
        return removed
    prefix = temporary_prefix(target)  # once: a folder may hold many siblings that are not ours
    for entry in siblings:
        if not entry.name.startswith(prefix) or not dead_temporary_of(entry, target, folder=folder):
            continue
        try:
            if folder:
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:  # gone meanwhile, or not ours to delete: leave it
            continue
        removed.append(Path(entry.path))
    return removed


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


def _kind(path: Path) -> str | None:
    """``file``, ``folder``, ``special`` (FIFO, device, socket; through links), or None if absent."""
    try:
        mode = path.stat().st_mode  # follows links: a link to a FIFO is a FIFO here
    except (FileNotFoundError, NotADirectoryError):
        return None  # absent (or cannot exist): writing it reports the real cause
    except OSError:
        return "special"  # a link loop or an unreadable entry: nothing to replace blindly
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    return "special"


def check_regular(path: str | os.PathLike, *, folder: bool) -> None:
    """Raise :class:`InputError` unless ``path`` is absent or a regular file (``folder``: a folder).

    Example:
        >>> check_regular("/dev/null", folder=False)
        Traceback (most recent call last):
        ...
        balancer_cli.errors.InputError: output /dev/null is not a regular file or folder (a FIFO, device or socket); fix: write the output to a regular file path
    """
    path = Path(path)
    kind = _kind(path)
    if kind == "special":
        raise InputError(f"output {path} is not a regular file or folder (a FIFO, device or socket)",
                         fix="write the output to a regular file path")
    if kind == "folder" and not folder:
        raise InputError(f"output {path} is a folder", fix="name a file path for the output")
    if kind == "file" and folder:
        raise InputError(f"output {path} is a file, not a folder", fix="name a folder path for the output")


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_output(output: str | os.PathLike, inputs: Sequence[str | os.PathLike], *, folder: bool = False) -> None:
    """Refuse an output that is not a regular file/folder, or that is, holds or lies inside an input.

    Compares real paths (links resolved) and, where both exist, file identity (hard links), so
    ``-o data.json`` for the input ``./x/../data.json`` or a link to it is refused before any work.

    Args:
        output: the output path.
        inputs: the command's input files and folders.
        folder: the output is a folder (``pack -o OUT``): an input inside it is refused too.

    Raises:
        InputError: one line naming the output and the input.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> check_output(f"{d}/lengths.parquet", [f"{d}/data.json"])
        >>> try:
        ...     check_output(f"{d}/x/../data.json", [f"{d}/data.json"])
        ... except InputError as error:
        ...     print(error.message.endswith(f"is also an input ({d}/data.json)"), error.fix)
        True write the output to another path
    """
    out = Path(output)
    check_regular(out, folder=folder)
    real_out = os.path.realpath(out)
    fix = "write the output to another path"
    for given in inputs:
        source = Path(given)
        real_in = os.path.realpath(source)
        same = real_in == real_out
        if not same and out.exists() and source.exists():
            try:
                same = os.path.samefile(out, source)
            except OSError:
                same = False
        if same:
            raise InputError(f"output {out} is also an input ({source})", fix=fix)
        if folder and _inside(real_in, real_out):
            raise InputError(f"input {source} is inside the output folder {out}, which is replaced", fix=fix)
        if source.is_dir() and _inside(real_out, real_in):
            raise InputError(f"output {out} is inside the input folder {source}", fix=fix)
    check_writable(out)


def check_writable(output: str | os.PathLike) -> None:
    """Refuse, before any work, an output whose folder cannot be written: its nearest existing
    folder is a file, or a file of our own cannot be created there (read-only, ``/sys``, ``/proc``).

    Raises:
        InputError: one line naming the output and the folder.

    Example:
        >>> check_writable("/proc/balancer-out.parquet")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        balancer_cli.errors.InputError: cannot write /proc/balancer-out.parquet: /proc is not writable (...); fix: ...
    """
    out = Path(output)
    folder = out.parent
    while not folder.exists() and folder != folder.parent:  # the folders write would create
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"cannot write {out}: {folder} is a file, not a folder",
                         fix="name an output path under a folder")
    # A file of our own, removed at once (permissions alone miss read-only mounts and root).
    probe = temporary_sibling(out, folder, folder=False)
    try:
        create_new(probe, folder=False)
    except OSError as error:
        raise InputError(f"cannot write {out}: {folder} is not writable ({error.strerror or error})",
                         fix="choose a writable folder for the output") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def claim_parts_dir(path: str | os.PathLike) -> Path:
    """Create the work folder ``path`` with :data:`PARTS_MARKER`, or accept one that carries it.

    Raises:
        InputError: ``path`` exists but is not balancer's (no marker and not empty), or is a file.
    """
    path = Path(path)
    marker = path / PARTS_MARKER
    if path.is_dir() and not marker.is_file() and any(path.iterdir()):
        raise InputError(f"{path} exists and was not created by balancer (no {PARTS_MARKER} in it); "
                         "it is left untouched", fix="move that folder away or delete it yourself")
    if os.path.lexists(path) and not path.is_dir():
        raise InputError(f"{path} exists and is not a folder", fix="move it away")
    path.mkdir(parents=True, exist_ok=True)
    if not marker.is_file():
        marker.write_text("created by balancer_cli; deleted with this folder once the output is written\n")
    return path


def remove_parts_dir(path: str | os.PathLike) -> None:
    """Delete the work folder ``path`` if it carries :data:`PARTS_MARKER` (else leave it)."""
    path = Path(path)
    if (path / PARTS_MARKER).is_file() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
