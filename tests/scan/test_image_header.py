"""Header-only image sizes: parity with Pillow, EXIF orientation, huge images, corrupt files."""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from balancer_cli.errors import SampleError
from balancer_cli.scan.image_header import MAX_SIDE, read_image_size

FORMATS = {  # format -> (mode, save kwargs)
    "PNG": ("RGBA", {}), "JPEG": ("RGB", {}), "GIF": ("P", {}), "WEBP": ("RGB", {}),
    "BMP": ("RGB", {}), "TIFF": ("RGB", {}),
}


def _encode(fmt: str, size: tuple[int, int], mode: str | None = None, **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.new(mode or FORMATS[fmt][0], size).save(buf, fmt, **{**FORMATS.get(fmt, ("", {}))[1], **kwargs})
    return buf.getvalue()


class CountingReader(io.BytesIO):
    """A stream that counts the bytes read from it."""

    bytes_read = 0

    def read(self, n=-1):
        data = super().read(n)
        self.bytes_read += len(data)
        return data


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("size", [(1, 1), (640, 480), (480, 640), (3, 1500), (1001, 7)])
def test_matches_pillow(fmt, size, tmp_path):
    data = _encode(fmt, size)
    path = tmp_path / f"img.{fmt.lower()}"
    path.write_bytes(data)
    with Image.open(path) as im:
        assert im.size == size
    assert read_image_size(path) == read_image_size(str(path)) == read_image_size(data) == size
    with open(path, "rb") as fp:
        assert read_image_size(fp) == size


@pytest.mark.parametrize("fmt,kwargs", [
    ("JPEG", {"progressive": True}), ("JPEG", {"mode": "L"}), ("JPEG", {"mode": "CMYK"}),
    ("WEBP", {"lossless": True}), ("WEBP", {"mode": "RGBA"}), ("PNG", {"mode": "1"}),
    ("PNG", {"mode": "I;16"}), ("TIFF", {"compression": "tiff_lzw"}), ("TIFF", {"big_tiff": True}),
    ("BMP", {"mode": "1"}), ("GIF", {"mode": "L"}),
])
def test_format_variants(fmt, kwargs):
    kwargs = dict(kwargs)
    mode = kwargs.pop("mode", None)
    assert read_image_size(_encode(fmt, (77, 33), mode, **kwargs)) == (77, 33)


def test_animated_and_bmp_variants():
    frames = [Image.new("RGB", (50, 20), c) for c in ("red", "blue")]
    for fmt in ("GIF", "WEBP"):
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:])
        assert read_image_size(buf.getvalue()) == (50, 20)
    bmp = bytearray(_encode("BMP", (30, 12)))
    bmp[22:26] = struct.pack("<i", -12)  # top-down rows: negative height
    assert read_image_size(bytes(bmp)) == (30, 12)
    os2 = b"BM" + bytes(12) + struct.pack("<IHHHH", 12, 31, 13, 1, 24) + bytes(64)
    assert read_image_size(os2) == (31, 13)


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), width=st.integers(1, 3000), height=st.integers(1, 3000))
def test_random_sizes_match_pillow(fmt, width, height):
    mode = {"JPEG": "L", "WEBP": "L", "GIF": "L"}.get(fmt, "1")
    data = _encode(fmt, (width, height), mode)
    assert read_image_size(data) == Image.open(io.BytesIO(data)).size == (width, height)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_like_hf_loaders(fmt, orientation):
    image = Image.new("RGB", (90, 40))
    buf = io.BytesIO()
    if fmt == "TIFF":
        image.save(buf, fmt, tiffinfo={274: orientation})
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.save(buf, fmt, exif=exif.tobytes())
    data = buf.getvalue()
    decoded = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size  # what transformers/datasets see
    assert read_image_size(data) == decoded
    assert read_image_size(data, apply_exif_orientation=False) == (90, 40)
    assert decoded == ((40, 90) if orientation >= 5 else (90, 40))


def _huge_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of any size in a few KB (all-zero rows compress to almost nothing)."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    row = bytes(1 + (width + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_huge_png_costs_what_a_small_one_costs(tmp_path):
    limit = Image.MAX_IMAGE_PIXELS
    huge, small = _huge_png(20000, 20000), _huge_png(20, 20)
    with pytest.raises(Image.DecompressionBombError):  # what a naive Image.open does
        Image.open(io.BytesIO(huge))
    reads = []
    for data in (huge, small):
        stream = CountingReader(data)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            read_image_size(stream)
        reads.append(stream.bytes_read)
    assert reads[0] == reads[1] < 200
    (tmp_path / "huge.png").write_bytes(huge)
    assert read_image_size(tmp_path / "huge.png") == (20000, 20000)
    assert Image.MAX_IMAGE_PIXELS == limit  # Pillow's global setting untouched


def test_huge_images_of_other_formats_read_headers_only():
    jpeg = bytearray(_encode("JPEG", (16, 16)))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", 60000, 50000)
    stream = CountingReader(bytes(jpeg))
    assert read_image_size(stream) == (50000, 60000)
    assert stream.bytes_read < 1000
    # Formats without a parser of ours go through Pillow's plugin: still no bomb check.
    assert read_image_size(b"P5\n30000 30000\n255\n") == (30000, 30000)


@pytest.mark.parametrize("fmt", ["ICO", "PPM", "TGA", "PCX", "SGI", "QOI"])
def test_other_pillow_formats(fmt):
    data = _encode(fmt, (64, 48), "RGB")
    assert read_image_size(data) == Image.open(io.BytesIO(data)).size


def _kind(source) -> tuple[str, str]:
    with pytest.raises(SampleError) as info:
        read_image_size(source)
    return info.value.kind, str(info.value)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_truncated_headers_are_corrupt(fmt, tmp_path):
    data = _encode(fmt, (64, 48), **({"exif": b""} if fmt == "JPEG" else {}))
    cut = {"PNG": 20, "JPEG": 30, "GIF": 8, "WEBP": 24, "BMP": 20, "TIFF": 6}[fmt]
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(data[:cut])
    kind, message = _kind(path)
    assert kind == "corrupt_image" and str(path) in message


def test_corrupt_and_unsupported_files(tmp_path):
    png = bytearray(_encode("PNG", (64, 48)))
    png[17] ^= 0xFF  # flip a bit of the width: the IHDR CRC no longer matches
    assert _kind(bytes(png))[0] == "corrupt_image"
    zero = _huge_png(0, 5)
    assert _kind(zero)[0] == "corrupt_image"
    jpeg = _encode("JPEG", (64, 48))
    assert _kind(jpeg[:jpeg.index(b"\xff\xc0")])[0] == "corrupt_image"
    assert _kind(b"\xff\xd8\xff\xda\x00\x04\x00\x00")[0] == "corrupt_image"  # scan data before SOF
    tiff = bytearray(_encode("TIFF", (8, 8)))
    tiff[4:8] = struct.pack("<I", 10_000_000)  # first directory beyond the end of the file
    assert _kind(bytes(tiff))[0] == "corrupt_image"
    assert _kind(b"")[0] == "corrupt_image"
    assert _kind(b"P5\n300")[0] == "corrupt_image"  # Pillow-plugin format, header cut short
    junk = tmp_path / "notes.jpg"
    junk.write_bytes(b"hello, this is not an image at all" * 3)
    kind, message = _kind(junk)
    assert kind == "unsupported_image" and "notes.jpg" in message
    kind, message = _kind(tmp_path / "absent.png")
    assert kind == "missing_file" and "absent.png" in message
    assert _kind(tmp_path)[0] == "missing_file"  # a directory


def test_stream_is_read_from_its_start():
    stream = io.BytesIO(_encode("PNG", (12, 34)))
    stream.seek(10)
    assert read_image_size(stream) == (12, 34)


def _png_header(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR chunk only: all a header read takes."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))


def test_headers_past_what_a_file_holds_are_corrupt_images():
    """A BigTIFF directory offset past what a seek takes (ValueError), a DDS of unknown pixel flags
    (Pillow's NotImplementedError) and a PNG claiming 2^31 - 1 a side were a generic
    ``malformed_record`` or a 65,536-token image; each is the image's ``corrupt_image`` error."""
    bigtiff = b"II+\x00\x08\x00\x00\x00" + struct.pack("<Q", 2**63) + bytes(50)
    dds = b"DDS " + struct.pack("<IIII", 124, 0, 2**31, 2**31) + bytes(120)
    for data in (bigtiff, dds, _png_header(2**31 - 1, 2**31 - 1), _png_header(MAX_SIDE + 1, 10)):
        kind, message = _kind(data)
        assert kind == "corrupt_image" and "fix: re-encode" in message, message
    assert "absurd size 2147483647x2147483647" in _kind(_png_header(2**31 - 1, 2**31 - 1))[1]
    assert read_image_size(_png_header(MAX_SIDE, 10)) == (MAX_SIDE, 10)  # the limit itself is a picture
