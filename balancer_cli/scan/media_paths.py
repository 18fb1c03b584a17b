"""Where a record's media file is and what may be opened: paths resolved and contained, headers read.

A relative path resolves against the block's image root and must stay inside it twice: as written
(``..``, absolute paths) and after resolving every symlink, unless its real path lies in one of
``media_roots`` (:class:`~balancer_cli.scan.measure.ScanConfig`). The header readers open only
regular files (:mod:`~balancer_cli.scan.image_header`, :mod:`~balancer_cli.scan.media_header`);
their errors name the file as the record does, never with the file's bytes.

Example:
    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> resolve_media_path("a/b.png", str(root)) == str(root / "a" / "b.png")
    True
    >>> resolve_media_path("../etc/passwd", str(root))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    balancer_cli.errors.SampleError: image path '../etc/passwd' escapes the image root ...
"""

from __future__ import annotations

import base64
import functools
import os
from typing import Any

from balancer_cli.errors import SampleError
from balancer_cli.scan.records import Media, RecordError
from balancer_cli.scan.tar_window import MemberRef, TarWindow

__all__ = ["fill_from_header", "image_size", "media_source", "read_header", "resolve_media_path"]


def _inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=4096)
def _real_dir(path: str) -> str:
    # Folders are few and shared by many files: one realpath each per process.
    return os.path.realpath(path)


def _real_path(full: str) -> str:
    """``os.path.realpath(full)`` with the folder's part cached: one ``lstat`` per file."""
    if os.path.islink(full):
        return os.path.realpath(full)
    folder, name = os.path.split(full)
    return os.path.join(_real_dir(folder), name)


def resolve_media_path(ref: str, root: str, kind: str = "image", media_roots: tuple[str, ...] = ()) -> str:
    """Absolute path of ``ref`` under ``root``; raises path_escape when it leaves the root.

    Two checks: the path as written (``..``, absolute paths) must stay inside ``root``, and so must
    the real path it resolves to after every symlink, unless it lands inside one of
    ``media_roots`` (folders a symlinked data folder may point into): a symlink planted in the
    dataset cannot make the scan read ``/etc/passwd``.

    Example:
        >>> import pathlib, tempfile
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "link.png").symlink_to("/etc/hostname")
        >>> resolve_media_path("link.png", str(root))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        balancer_cli.errors.SampleError: image path 'link.png' is a symlink leading out of the image root ...
    """
    ref = ref.removeprefix("file://")
    if "\x00" in ref:
        raise RecordError(f"{kind} path {ref[:60]!r} holds a NUL byte")
    if not ref.strip():  # (it would name the root folder itself)
        raise RecordError(f"{kind} path is empty ({ref!r})", fix=f"give the {kind}'s file, or drop the {kind} field")
    base = os.path.normpath(os.path.abspath(root))
    full = os.path.normpath(os.path.join(base, ref))
    fix = f"keep {kind} paths inside --image-root (or pass a wider --image-root)"
    if not _inside(full, base):
        raise SampleError(f"{kind} path {ref!r} escapes the image root {root!r}", kind="path_escape", fix=fix)
    real = _real_path(full)
    if real != full and not any(_inside(real, _real_dir(r)) for r in (base, *media_roots)):
        raise SampleError(f"{kind} path {ref!r} is a symlink leading out of the image root {root!r}",
                          kind="path_escape", fix=fix)
    return full


#: The record fields that spare opening each kind of media file (named when a remote file lacks them).
_SIZE_FIELDS = {"image": "width/height", "video": "duration (and width/height)", "audio": "duration"}


def media_source(media: Media, root: str, media_roots: tuple[str, ...] = ()) -> str | bytes | TarWindow:
    """The path (resolved under ``root``) or the bytes of a media item (``data:`` URLs decoded), or
    a window over its tar member (closed by :func:`read_header`).

    Example:
        >>> media_source(Media("image", "data:image/gif;base64,R0lGODlh"), ".")
        b'GIF89a'
    """
    kind, ref = media.kind, media.ref
    if isinstance(ref, MemberRef):
        try:
            return TarWindow(ref)
        except OSError as exc:
            raise SampleError(f"{kind} member {ref.name} unreadable: cannot open {ref.shard} "
                              f"({exc.strerror or exc})", kind="unreadable_file") from None
    if isinstance(ref, str) and ref.startswith("data:") and ";base64," in ref:
        try:
            return base64.b64decode(ref.split(";base64,", 1)[1], validate=True)
        except ValueError:
            raise SampleError(f"{kind} data URL is not valid base64", kind=f"corrupt_{kind}") from None
    if isinstance(ref, str):
        if ref.startswith(("http://", "https://")):
            raise SampleError(f"remote {kind} {ref[:80]!r} has no {_SIZE_FIELDS[kind]} fields",
                              kind=f"unsupported_{kind}",
                              fix=f"add {_SIZE_FIELDS[kind]} to the record (the scan never downloads)")
        return resolve_media_path(ref, root, kind, media_roots)
    return ref


def read_header(media: Media, source: str | bytes | TarWindow, reader: Any) -> Any:
    """``reader(source)``, its errors naming the file as the record does (the table must not
    depend on where it was scanned); a tar member's window is closed afterwards."""
    try:
        return reader(source)
    except SampleError as exc:
        if not isinstance(source, str):
            raise
        ref = media.ref
        if exc.kind == "missing_file" and "not found" in exc.message:
            raise SampleError(f"{media.kind} not found: {ref}", kind="missing_file",
                              fix="check --image-root or the record's path") from None
        message = exc.message.replace(source, ref) if source in exc.message else f"{ref}: {exc.message}"
        raise SampleError(message, kind=exc.kind, fix=exc.fix) from None
    except OSError as exc:  # a read failing after the open (the readers report failed opens)
        raise SampleError(f"{media.kind} unreadable: {media.ref} ({exc.strerror or exc})",
                          kind="unreadable_file") from None
    finally:
        if isinstance(source, TarWindow):
            source.close()


def image_size(media: Media, root: str, media_roots: tuple[str, ...] = ()) -> tuple[int, int]:
    """``(width, height)`` of an image: the record's size fields, else its file's (or bytes') header.

    Example:
        >>> image_size(Media("image", "any.png", width=640, height=480), ".")
        (640, 480)
    """
    from balancer_cli.scan.image_header import read_image_size

    if media.width is not None and media.height is not None:
        return media.width, media.height
    if media.ref is None:
        raise RecordError("image without a path, bytes or width/height")
    return read_header(media, media_source(media, root, media_roots), read_image_size)


def fill_from_header(media: Media, root: str, media_roots: tuple[str, ...] = ()) -> None:
    """Give a video without ``duration``/``num_frames`` (an audio clip without ``duration``) the
    values of its file's header; fields the record has win."""
    from balancer_cli.scan.media_header import read_audio_info, read_video_info

    if media.duration is not None or (media.kind == "video" and media.num_frames):
        return
    if media.ref is None:
        return  # _measure_media reports the missing metadata
    source = media_source(media, root, media_roots)
    if media.kind == "video":
        info = read_header(media, source, read_video_info)
        media.num_frames = media.num_frames or info.num_frames
        media.fps = media.fps or info.fps
        media.width = media.width or info.width
        media.height = media.height or info.height
    else:
        info = read_header(media, source, read_audio_info)
        media.sample_rate = media.sample_rate or info.sample_rate
    media.duration = info.duration
