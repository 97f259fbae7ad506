"""Image decoding and the cache key of an image's embeddings, in plain numpy + Pillow.

Decoding mirrors vLLM's own image loading (EXIF orientation, transparency over white) so an
EPD request sees the same pixels as a plain vLLM server. What happens to the pixels next is a
model family's business (``orchestrator.families``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io

import numpy as np
from PIL import Image, ImageOps

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
"""Decoded-size cap (checked from the header, before decoding) against decompression bombs."""

_MAGIC = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
)


class ImageTooLarge(ValueError):
    """The image's header claims more pixels than the deployment accepts."""


def decode_image(data: bytes | str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode JPEG/PNG/WebP bytes, or base64 text of them (data URLs too), to an RGB image.

    Raises ``ValueError`` for anything that is not a well-formed image of an allowed format or
    whose header claims more than ``max_pixels`` pixels.
    """
    img = open_image(data, max_pixels)
    try:
        img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"corrupt {img.format} image: {e}") from e
    # Like vLLM: honour EXIF orientation, but a broken EXIF block leaves the image as stored.
    with contextlib.suppress(Exception):
        img = ImageOps.exif_transpose(img)
    return _to_rgb(img)


def open_image(data: bytes | str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """The image with only its header read: format and size checked, pixels not decoded
    (cheap enough for the public edge to refuse a decompression bomb before any stage)."""
    raw = _as_image_bytes(data)
    try:
        img = Image.open(io.BytesIO(raw), formats=ALLOWED_FORMATS)
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a decodable {'/'.join(ALLOWED_FORMATS)} image: {e}") from e
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ValueError(f"image header claims {width}x{height} pixels")
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}"
        )
    return img


def _as_image_bytes(data: bytes | str) -> bytes:
    """Return raw image bytes, base64-decoding ``data`` unless it already is an image."""
    if not data:
        raise ValueError("empty image data")
    if isinstance(data, bytes | bytearray | memoryview):
        data = bytes(data)
        if _sniff(data):
            return data
        try:
            data = data.decode("ascii")
        except UnicodeDecodeError as e:
            raise ValueError("bytes are neither a JPEG/PNG/WebP image nor base64 text") from e
    if not isinstance(data, str):
        raise TypeError(f"expected bytes or str, got {type(data).__name__}")
    text = data.strip()
    if text.startswith("data:"):
        header, sep, text = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError("data URL must be base64-encoded (data:<type>;base64,<data>)")
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"invalid base64 image data: {e}") from e
    if not _sniff(raw):
        raise ValueError("base64 payload is not a JPEG/PNG/WebP image")
    return raw


def _sniff(raw: bytes) -> str | None:
    """Format from magic bytes; cheap rejection before Pillow sees untrusted data."""
    for magic, fmt in _MAGIC:
        if raw.startswith(magic):
            return fmt
    if len(raw) >= 12 and raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WEBP"
    return None


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB with transparent areas over white, as vLLM's image loader does."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img.convert("RGB")


def content_hash(image: Image.Image | np.ndarray, preprocessing: str, encoder_id: str) -> str:
    """Cache key of an image's embeddings: decoded RGB pixels + preprocessing + encoder.

    ``preprocessing`` is the family's fingerprint of its settings
    (``ModelFamily.preprocess_fingerprint``).

    Two requests share embeddings only if all three agree, independent of how the image was
    transported (PNG vs base64 vs a re-encoded lossless copy).
    """
    if isinstance(image, Image.Image):
        # The conversion every family's preprocessing starts with: equal hashes, equal inputs.
        pixels = np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)
    else:
        pixels = np.asarray(image)
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"expected uint8 [H, W, 3] pixels, got {pixels.dtype} {pixels.shape}")
    h = hashlib.sha256()
    h.update(b"epd-image-v1\0")
    h.update(f"{pixels.shape[0]}x{pixels.shape[1]}\0".encode())
    h.update(np.ascontiguousarray(pixels).data)
    h.update(preprocessing.encode() + b"\0")
    h.update(encoder_id.encode())
    return h.hexdigest()
