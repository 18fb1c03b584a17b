"""Image sizes from file headers only: never decodes pixels, never trips a decompression-bomb check.

``read_image_size`` parses PNG, JPEG, GIF, WEBP, BMP and TIFF (classic and BigTIFF) headers
itself, reading a few dozen bytes (JPEG: one small read per segment until the frame header), so a
20,000 x 20,000 PNG costs what a thumbnail costs. Other formats Pillow knows (ICO, PPM, TGA,
JPEG 2000, ...) go through Pillow's format plugin directly, which reads the header only and skips
``Image.open``'s decompression-bomb check without touching Pillow's global settings.

EXIF orientation: transformers' ``load_image`` and ``datasets.Image`` apply
``ImageOps.exif_transpose``, so by default a JPEG/PNG/WEBP/TIFF whose orientation is 5-8 (rotated
by 90 degrees) reports ``(height, width)`` of the stored pixels, i.e. the size the processor sees.
Training code that loads with a bare ``Image.open(p).convert("RGB")`` (LLaVA, InternVL repos) sees
the stored size: pass ``apply_exif_orientation=False`` there.

Example:
    >>> import io
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGB", (640, 480)).save(buf, "PNG")
    >>> read_image_size(buf.getvalue())
    (640, 480)
"""

from __future__ import annotations

import io
import os
import re
import stat
import struct
import zlib
from typing import BinaryIO, Union

from balancer_cli.errors import SampleError

__all__ = ["MAX_SIDE", "ImageSource", "read_image_size", "open_regular"]

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]

_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_ORIENTATION_TAG = 0x0112
#: The longest side an image header may declare: what a record's width and height may give
#: (:data:`balancer_cli.scan.records.FIELD_LIMITS`); past it a header is corrupt, not a picture.
MAX_SIDE = 1 << 20
_MAX_EXIF_BYTES = 1 << 20


class _Corrupt(Exception):
    """Internal: the header is malformed or cut short (becomes a ``corrupt_image`` SampleError)."""


class _Unsupported(Exception):
    """Internal: not a format we parse (the Pillow plugin fallback is tried next)."""


def _read(fp: BinaryIO, n: int) -> bytes:
    data = fp.read(n)
    if len(data) != n:
        raise _Corrupt(f"file ends inside the header (wanted {n} bytes, got {len(data)})")
    return data


def _exif_orientation(data: bytes) -> int:
    """Orientation tag (1..8) of a TIFF-structured EXIF block (with or without ``Exif\\0\\0``)."""
    if data.startswith(b"Exif\x00\x00"):
        data = data[6:]
    if len(data) < 8 or data[:2] not in (b"II", b"MM"):
        return 1
    end = "<" if data[:2] == b"II" else ">"
    try:
        (ifd,) = struct.unpack_from(end + "I", data, 4)
        (count,) = struct.unpack_from(end + "H", data, ifd)
        for i in range(count):
            tag, typ, _, value = struct.unpack_from(end + "HHI4s", data, ifd + 2 + 12 * i)
            if tag == _ORIENTATION_TAG and typ == 3:
                (orientation,) = struct.unpack_from(end + "H", value)
                return orientation if 1 <= orientation <= 8 else 1
    except struct.error:
        return 1  # a broken EXIF block does not stop loaders either: they ignore it
    return 1


def _png(fp: BinaryIO, head: bytes) -> tuple[int, int, int]:
    if len(head) < 33 or head[12:16] != b"IHDR":
        raise _Corrupt("PNG without a complete IHDR chunk")
    if zlib.crc32(head[12:29]) != struct.unpack(">I", head[29:33])[0]:
        raise _Corrupt("PNG IHDR chunk fails its CRC check")
    width, height = struct.unpack(">II", head[16:24])
    orientation, pos = 1, 33
    while True:  # look for eXIf before the image data (where encoders put it)
        fp.seek(pos)
        chunk = fp.read(8)
        if len(chunk) < 8:
            break
        length, kind = struct.unpack(">I4s", chunk)
        if kind in (b"IDAT", b"IEND"):
            break
        if kind == b"eXIf" and length <= _MAX_EXIF_BYTES:
            orientation = _exif_orientation(fp.read(length))
            break
        pos += 12 + length
    return width, height, orientation


def _gif(fp: BinaryIO, head: bytes) -> tuple[int, int, int]:
    if len(head) < 10:
        raise _Corrupt("GIF shorter than its logical screen descriptor")
    width, height = struct.unpack("<HH", head[6:10])
    return width, height, 1


def _bmp(fp: BinaryIO, head: bytes) -> tuple[int, int, int]:
    if len(head) < 26:
        raise _Corrupt("BMP shorter than its info header")
    (header_size,) = struct.unpack("<I", head[14:18])
    if header_size == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack("<HH", head[18:22])
    elif header_size >= 40:
        width, height = struct.unpack("<ii", head[18:26])
    else:
        raise _Corrupt(f"BMP info header of unknown size {header_size}")
    return width, abs(height), 1  # negative height = top-down rows


def _webp(fp: BinaryIO, head: bytes) -> tuple[int, int, int]:
    if len(head) < 30:
        raise _Corrupt("WEBP shorter than its first chunk header")
    kind = head[12:16]
    if kind == b"VP8 ":
        if head[23:26] != b"\x9d\x01\x2a":
            raise _Corrupt("WEBP VP8 frame without its start code")
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF, 1
    if kind == b"VP8L":
        if head[20] != 0x2F:
            raise _Corrupt("WEBP VP8L chunk without its signature byte")
        (bits,) = struct.unpack("<I", head[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, 1
    if kind == b"VP8X":
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        orientation = 1
        if head[20] & 0x08:  # EXIF flag: walk the chunks to find it
            (riff_size,) = struct.unpack("<I", head[4:8])
            pos = 12
            while pos + 8 <= riff_size + 8:
                fp.seek(pos)
                chunk = fp.read(8)
                if len(chunk) < 8:
                    break
                name, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
                if name == b"EXIF" and size <= _MAX_EXIF_BYTES:
                    orientation = _exif_orientation(fp.read(size))
                    break
                pos += 8 + size + (size & 1)
        return width, height, orientation
    raise _Unsupported(f"WEBP chunk {kind.decode('ascii') if kind.isalnum() else kind.hex()}")


def _tiff(fp: BinaryIO, head: bytes) -> tuple[int, int, int]:
    end = "<" if head[:2] == b"II" else ">"
    (version,) = struct.unpack(end + "H", head[2:4])
    big = version == 43
    fp.seek(8 if big else 4)
    (ifd,) = struct.unpack(end + ("Q" if big else "I"), _read(fp, 8 if big else 4))
    fp.seek(ifd)
    (count,) = struct.unpack(end + ("Q" if big else "H"), _read(fp, 8 if big else 2))
    entry = 20 if big else 12
    if count > 4096:
        raise _Corrupt(f"TIFF first directory claims {count} entries")
    block = _read(fp, count * entry)
    tags: dict[int, int] = {}
    for i in range(count):
        if big:
            tag, typ, _, raw = struct.unpack_from(end + "HHQ8s", block, i * entry)
        else:
            tag, typ, _, raw = struct.unpack_from(end + "HHI4s", block, i * entry)
        if tag in (256, 257, _ORIENTATION_TAG):
            if typ == 3:
                tags[tag] = struct.unpack_from(end + "H", raw)[0]
            elif typ in (4, 16):
                tags[tag] = struct.unpack_from(end + ("Q" if typ == 16 else "I"), raw)[0]
    if 256 not in tags or 257 not in tags:
        raise _Corrupt("TIFF first directory lacks ImageWidth/ImageLength")
    orientation = tags.get(_ORIENTATION_TAG, 1)
    return tags[256], tags[257], orientation if 1 <= orientation <= 8 else 1


def _jpeg(fp: BinaryIO, head: bytes) -> tuple[int, int, int]:
    fp.seek(2)
    orientation = 1
    while True:
        byte = fp.read(1)
        if not byte:
            raise _Corrupt("JPEG ends before its frame header (SOF)")
        if byte != b"\xff":
            continue  # junk between segments: decoders skip it too
        marker = 0xFF
        while marker == 0xFF:
            marker = _read(fp, 1)[0]
        if marker in (0x00, 0x01, 0xD8) or 0xD0 <= marker <= 0xD7:
            continue  # stuffing, TEM, SOI and RSTn carry no length
        if marker in (0xD9, 0xDA):
            raise _Corrupt("JPEG reaches image data before its frame header (SOF)")
        (length,) = struct.unpack(">H", _read(fp, 2))
        if length < 2:
            raise _Corrupt(f"JPEG segment 0x{marker:02X} with invalid length {length}")
        if marker in _JPEG_SOF:
            _, height, width = struct.unpack(">BHH", _read(fp, 5))
            return width, height, orientation
        if marker == 0xE1 and orientation == 1:
            payload = _read(fp, length - 2)
            if payload.startswith(b"Exif\x00\x00"):
                orientation = _exif_orientation(payload)
        else:
            fp.seek(length - 2, io.SEEK_CUR)


def _safe(exc: BaseException) -> str:
    """A decoder's message without the file's bytes (Pillow quotes some, e.g. an unknown BMP header)."""
    text = re.sub(r"b(['\"]).*?\1", "<bytes>", str(exc))
    return ascii(text)[1:-1][:100]


def _pillow_plugin(fp: BinaryIO, head: bytes, name: str) -> tuple[int, int, int]:
    """Header-only open through Pillow's format plugins (no pixel decode, no bomb check)."""
    from PIL import Image

    Image.init()  # registers every format plugin, as Image.open does
    failure = None
    for fmt in Image.ID:
        factory, accept = Image.OPEN[fmt]
        if accept is not None and not accept(head):
            continue
        fp.seek(0)
        try:
            image = factory(fp, name)
        except Exception as exc:  # noqa: BLE001 (a plugin raises what it likes on bad bytes: DDS NotImplementedError)
            if accept is not None and failure is None:  # its signature matched: a broken file
                failure = f"{fmt} header: {_safe(exc)}"
            continue
        return int(image.size[0]), int(image.size[1]), 1
    if failure is not None:
        raise _Corrupt(failure)
    raise _Unsupported("no known image signature")


_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG", _png),
    (b"\xff\xd8", "JPEG", _jpeg),
    (b"GIF87a", "GIF", _gif),
    (b"GIF89a", "GIF", _gif),
    (b"BM", "BMP", _bmp),
    (b"II*\x00", "TIFF", _tiff),
    (b"MM\x00*", "TIFF", _tiff),
    (b"II+\x00", "TIFF", _tiff),
    (b"MM\x00+", "TIFF", _tiff),
)


def _parse(fp: BinaryIO, name: str, apply_exif_orientation: bool) -> tuple[int, int]:
    head = fp.read(64)
    parser = None
    for magic, _, func in _SIGNATURES:
        if head.startswith(magic):
            parser = func
            break
    if parser is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        parser = _webp
    try:
        if parser is None:
            if not head:
                raise _Corrupt("empty file")
            width, height, orientation = _pillow_plugin(fp, head, name)
        else:
            width, height, orientation = parser(fp, head)
    except _Unsupported as exc:
        # The file's own bytes never go into the message: a path may lead to any file.
        raise SampleError(f"{name}: unsupported image format ({exc})",
                          kind="unsupported_image",
                          fix="convert the image to PNG/JPEG/WEBP, or drop the sample") from None
    except (_Corrupt, struct.error, ValueError, OverflowError) as exc:  # a seek past what an offset holds
        raise SampleError(f"{name}: corrupt or truncated image header ({_safe(exc)})", kind="corrupt_image",
                          fix="re-encode or re-download the image, or drop the sample") from None
    if width < 1 or height < 1:
        raise SampleError(f"{name}: image header declares an empty size {width}x{height}",
                          kind="corrupt_image", fix="re-encode the image, or drop the sample")
    if max(width, height) > MAX_SIDE:
        raise SampleError(f"{name}: image header declares an absurd size {width}x{height} (past {MAX_SIDE:,} a side)",
                          kind="corrupt_image", fix="re-encode the image, or drop the sample")
    if apply_exif_orientation and orientation >= 5:
        return height, width  # 90-degree rotations swap the sides
    return width, height


def read_image_size(source: ImageSource, *, apply_exif_orientation: bool = True) -> tuple[int, int]:
    """``(width, height)`` of an image file, its bytes, or a seekable binary stream; headers only.

    Args:
        source: a path, the encoded bytes, or a seekable binary file object (read from its start).
        apply_exif_orientation: report the size after EXIF rotation, as transformers'
            ``load_image`` and ``datasets.Image`` decode it (default); False gives the stored size.

    Raises:
        SampleError: ``kind="missing_file"`` (absent or unreadable path), ``"corrupt_image"``
            (malformed or truncated header, zero size) or ``"unsupported_image"`` (unknown
            format). The message names the image; ``file``/``line`` are left for the caller to
            set to the record's location.

    Example:
        >>> read_image_size(b"GIF89a\\x80\\x02\\xe0\\x01" + bytes(20))
        (640, 480)
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _parse(io.BytesIO(bytes(source)), "<image bytes>", apply_exif_orientation)
    if hasattr(source, "read"):
        name = str(getattr(source, "name", "<image stream>"))
        source.seek(0)
        return _parse(source, name, apply_exif_orientation)
    path = os.fspath(source)
    if "\x00" in path:
        raise SampleError(f"{path[:60]!r}: image path holds a NUL byte", kind="missing_file",
                          fix="fix the record's image path")
    fd, _ = open_regular(path, "an image", root="image", target="image")
    with os.fdopen(fd, "rb") as fp:
        return _parse(fp, path, apply_exif_orientation)


def open_regular(path: str, what: str, *, root: str, target: str) -> tuple[int, os.stat_result]:
    """``(fd, stat)`` of ``path`` opened for reading when it is a regular file; else the sample's
    ``missing_file`` error (not found, unreadable, a directory, a FIFO or a device).

    Opened with O_NONBLOCK and checked with ``fstat``: a FIFO never waits for a writer, and the
    file checked is the file read. The fd is blocking again when returned.

    Args:
        path: the media file.
        what: the media with its article, for messages ("an image", "a video").
        root: the folder the fix names ("check the {root} root / paths of the dataset").
        target: what the record should point at ("point the record at the {target} file itself").

    Example:
        >>> open_regular("no/such.png", "an image", root="image", target="image")
        Traceback (most recent call last):
        ...
        balancer_cli.errors.SampleError: no/such.png: image file not found; fix: check the image root / paths of the dataset
    """
    kind = what.split(" ", 1)[-1]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise SampleError(f"{path}: {kind} file not found", kind="missing_file",
                          fix=f"check the {root} root / paths of the dataset") from None
    except OSError as exc:
        raise SampleError(f"{path}: cannot open {kind} ({exc.strerror or exc})", kind="missing_file",
                          fix="check the file's permissions and that it is a regular file") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind_of = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise SampleError(f"{path}: is {kind_of}, not {what} file", kind="missing_file",
                          fix=f"point the record at the {target} file itself")
    if getattr(os, "O_NONBLOCK", 0):
        os.set_blocking(fd, True)
    return fd, info
