"""The benchmarks' images: real photos made distinct per request, so no cache answers
for anyone unless a workload means to measure a cache."""

from __future__ import annotations

import functools
import io

import numpy as np

from orchestrator.client import sample_photo


@functools.cache
def _photo_pixels(name: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(sample_photo(name))).convert("RGB"))


def photo_variant(
    name: str, serial: int, size: tuple[int, int] | None = None, quality: int = 75
) -> bytes:
    """The photo rolled sideways by ``serial`` pixels: same size (same work) but new content,
    so neither vLLM's prefix/multimodal caches nor ``epd``'s image hashes see a repeat.
    ``size``: then resized to (width, height); a JPEG of ``quality``."""
    from PIL import Image

    pixels = _photo_pixels(name)
    image = Image.fromarray(np.roll(pixels, serial % pixels.shape[1], axis=1))
    if size is not None:
        image = image.resize(size)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
