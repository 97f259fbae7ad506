"""Limits at the public edge: each refused with a message naming the input, before any
stage works (pure parsing, no servers)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from orchestrator.config import Limits
from orchestrator.frontend import parse_front_request
from orchestrator.protocol import InvalidRequest


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _noise_png(side: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _inputs(text: bytes = b"hi", images: list[bytes] | None = None) -> dict[str, np.ndarray]:
    inputs = {"text_input": np.array([text], dtype=np.object_)}
    if images is not None:
        inputs["image"] = np.array(images, dtype=np.object_)
    return inputs


LIMITS = Limits(
    max_images_per_request=3,
    max_image_bytes=4000,
    max_image_pixels=10_000,
    max_text_bytes=100,
    max_request_bytes=5000,
)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (_inputs(b"x" * 101), "text_input is 101 bytes; the limit is 100"),
        (_inputs(images=[_png(8, 8)] * 4), "4 images sent; this deployment accepts at most 3"),
        (_inputs(images=[_png(8, 8), b""]), "image 2 of 2 is empty"),
        (_inputs(images=[_png(8, 8), b"\x89PNG" + b"0" * 4000]), "image 2 of 2 is 4004 bytes"),
        (_inputs(images=[_png(8, 8), _png(101, 100)]), "image 2 of 2: 101x100 = 10100 pixels"),
        (_inputs(images=[_png(8, 8), b"GIF89a\x01\xff"]), "image 2 of 2: bytes are neither"),
        (
            _inputs(images=[_noise_png(32), b"\x89PNG" + bytes(2500)]),
            "request is over 5000 bytes at image 2 of 2",
        ),
    ],
    ids=["text", "count", "empty", "bytes", "pixels", "format", "total"],
)
def test_limits_name_the_input(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_front_request(inputs, LIMITS)


def test_a_request_within_the_limits_passes():
    request = parse_front_request(_inputs(images=[_png(100, 100)] * 3), LIMITS)
    assert len(request.images) == 3 and request.text == "hi"
