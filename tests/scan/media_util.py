"""Tiny media files for the scan tests, encoded with PyAV (import this module only after
``pytest.importorskip("av")``)."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest


def finish(out, stream) -> None:
    """Flush ``stream``'s encoder into ``out`` and close the container."""
    for packet in stream.encode():
        out.mux(packet)
    out.close()


def encode_video(target, codec: str, rate: Fraction, frames: int, width: int = 32, height: int = 24,
                 fmt: str | None = None, rotation: int | None = None, faststart: bool = False) -> None:
    """``frames`` frames of seeded noise at ``rate`` into ``target`` (a path or a binary stream);
    skips the test when PyAV has no ``codec`` encoder."""
    if codec not in av.codecs_available:
        pytest.skip(f"PyAV has no {codec} encoder here")
    out = av.open(target if not hasattr(target, "__fspath__") else str(target), "w", format=fmt,
                  options={"movflags": "faststart"} if faststart else {})
    stream = out.add_stream(codec, rate=rate)
    stream.width, stream.height = width, height
    stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    if rotation is not None:
        stream.set_display_rotation(rotation)
    for i in range(frames):
        pixels = np.random.default_rng(i).integers(0, 255, (height, width, 3), dtype=np.uint8)
        for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
            out.mux(packet)
    finish(out, stream)
