"""Image decoding must give the pixels vLLM's loader gives; the cache key follows pixels,
preprocessing and encoder, not how the image was sent. (Per-family preprocessing:
test_families.py.)"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import skimage.data
from PIL import Image

from orchestrator.encoder.preprocess import content_hash, decode_image


def _encode(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def test_png_jpeg_webp_and_base64_inputs() -> None:
    original = Image.fromarray(skimage.data.chelsea())
    png = _encode(original, "PNG")
    np.testing.assert_array_equal(np.asarray(decode_image(png)), np.asarray(original))
    for text in (
        base64.b64encode(png).decode(),
        base64.b64encode(png),  # base64 text carried as bytes
        "data:image/png;base64," + base64.b64encode(png).decode(),
        base64.encodebytes(png).decode(),  # MIME line breaks
    ):
        np.testing.assert_array_equal(np.asarray(decode_image(text)), np.asarray(original))
    jpeg = _encode(original, "JPEG", quality=90)
    decoded = decode_image(jpeg)
    assert decoded.mode == "RGB" and decoded.size == original.size
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(Image.open(io.BytesIO(jpeg))))
    webp = _encode(original, "WEBP", lossless=True)
    np.testing.assert_array_equal(np.asarray(decode_image(webp)), np.asarray(original))


def test_transparency_over_white_and_gray_to_rgb() -> None:
    rgba = np.zeros((40, 40, 4), dtype=np.uint8)
    rgba[:20, :, :] = (10, 20, 30, 255)
    decoded = np.asarray(decode_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG")))
    assert decoded.shape == (40, 40, 3)
    assert (decoded[:20] == (10, 20, 30)).all() and (decoded[20:] == 255).all()
    gray = decode_image(_encode(Image.fromarray(skimage.data.camera()), "PNG"))
    assert gray.mode == "RGB"


def test_exif_orientation_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    jpeg = _encode(Image.new("RGB", (64, 32), (200, 10, 10)), "JPEG", exif=exif)
    assert decode_image(jpeg).size == (32, 64)


def _png_header_claiming(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims a huge canvas: a decompression bomb's calling card."""
    png = _encode(Image.new("L", (1, 1)), "PNG")
    ihdr = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    chunk = struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
    return png[:8] + chunk + png[33:]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"\x00\x01\x02garbage\xff", "neither"),
        ("this is not base64!", "invalid base64"),
        (base64.b64encode(b"hello, world"), "not a JPEG/PNG/WebP"),
        ("data:image/png,rawdata", "data URL"),
        (_encode(Image.new("RGB", (8, 8)), "GIF"), "neither"),
        (_encode(Image.new("RGB", (64, 64)), "PNG")[:60], "corrupt|decodable"),
        (_encode(Image.fromarray(skimage.data.coffee()), "JPEG")[:5000], "corrupt|decodable"),
        (_png_header_claiming(100_000, 100_000), "limit"),
    ],
    ids=[
        "empty",
        "garbage",
        "bad-base64",
        "base64-of-text",
        "data-url-not-b64",
        "gif",
        "truncated-png",
        "truncated-jpeg",
        "pixel-bomb",
    ],
)
def test_decode_errors(data: bytes | str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_image(data)


def test_pixel_cap_is_configurable() -> None:
    png = _encode(Image.new("RGB", (100, 100)), "PNG")
    assert decode_image(png, max_pixels=10_000).size == (100, 100)
    with pytest.raises(ValueError, match="limit"):
        decode_image(png, max_pixels=9_999)


def test_content_hash(tiny_model) -> None:
    from orchestrator.families import family_for

    settings = family_for(tiny_model).preprocess_fingerprint()
    original = Image.fromarray(skimage.data.astronaut())
    png = _encode(original, "PNG")
    from_png = content_hash(decode_image(png), settings, "enc-a")
    from_b64 = content_hash(decode_image(base64.b64encode(png).decode()), settings, "enc-a")
    assert from_png == from_b64
    assert content_hash(np.asarray(original), settings, "enc-a") == from_png
    other_pixels = settings.replace('"max_pixels":50176', '"max_pixels":200704')
    assert other_pixels != settings
    assert content_hash(decode_image(png), other_pixels, "enc-a") != from_png
    assert content_hash(decode_image(png), settings, "enc-b") != from_png
    shifted = np.roll(np.asarray(original), 1, axis=1)
    assert content_hash(shifted, settings, "enc-a") != from_png
