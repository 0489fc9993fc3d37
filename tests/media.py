"""Images for the image-input tests, made on the spot (no files, no downloads)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import numpy as np


def noise_image(height: int, width: int, seed: int = 0) -> Any:
    """A PIL RGB image of random pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encode(image: Any, fmt: str = "PNG", **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **fields: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **fields}}


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG signature and header claiming width x height pixels, with a few bytes of
    compressed data: decompressing it all would take width * height bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    idat = zlib.compress(b"\0" * 65536, 9)
    chunks = chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks
