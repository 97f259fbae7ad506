"""Image decoding and preprocessing must match what HF / vLLM would compute from the pixels."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoProcessor
from transformers.vision_utils import get_vision_position_ids

from orchestrator.encoder.preprocess import (
    PreprocessConfig,
    content_hash,
    decode_image,
    preprocess,
    segment_ids,
    smart_resize,
    vision_position_ids,
)


def _encode(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def hf_pil_processor(tiny_model):
    return AutoImageProcessor.from_pretrained(tiny_model, backend="pil")


@pytest.fixture(scope="module")
def hf_default_processor(tiny_model):
    """What vLLM loads: AutoProcessor picks the torchvision backend when it is importable."""
    return AutoProcessor.from_pretrained(tiny_model).image_processor


def test_config_read_from_saved_processor(preprocess_cfg: PreprocessConfig) -> None:
    assert preprocess_cfg.min_pixels == 56 * 56
    assert preprocess_cfg.max_pixels == 224 * 224
    assert (preprocess_cfg.patch_size, preprocess_cfg.merge_size) == (14, 2)
    assert preprocess_cfg.temporal_patch_size == 2
    assert preprocess_cfg.patch_dim == 1176
    assert preprocess_cfg.resample == int(Image.Resampling.BICUBIC)


def test_matches_hf_pil_processor(photo, preprocess_cfg, hf_pil_processor) -> None:
    pixel_values, grid = preprocess(photo, preprocess_cfg)
    ref = hf_pil_processor(images=[photo], return_tensors="np")
    assert grid == tuple(ref["image_grid_thw"][0])
    assert pixel_values.dtype == np.float32
    assert pixel_values.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(pixel_values, ref["pixel_values"], rtol=0, atol=1e-6)


def test_close_to_default_processor(photo, preprocess_cfg, hf_default_processor) -> None:
    """vLLM's default (torchvision) resize may differ from PIL's by one 8-bit level when
    downscaling; grids, and so token counts, must agree exactly."""
    pixel_values, grid = preprocess(photo, preprocess_cfg)
    ref = hf_default_processor(images=[photo], return_tensors="np")
    assert grid == tuple(ref["image_grid_thw"][0])
    if photo.height * photo.width > preprocess_cfg.max_pixels:
        one_level = 1 / 255 / min(preprocess_cfg.image_std) + 1e-6
        assert np.abs(pixel_values - ref["pixel_values"]).max() <= one_level


@pytest.mark.parametrize(
    "size", [(30, 500), (500, 30), (1, 150), (56, 56), (224, 224), (225, 224), (4000, 3000)]
)
def test_smart_resize_bounds(size: tuple[int, int], preprocess_cfg: PreprocessConfig) -> None:
    height, width = smart_resize(*size, preprocess_cfg)
    assert height % 28 == 0 and width % 28 == 0
    assert preprocess_cfg.min_pixels <= height * width <= preprocess_cfg.max_pixels


def test_smart_resize_rejects_extreme_aspect(preprocess_cfg: PreprocessConfig) -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, preprocess_cfg)


@pytest.mark.parametrize("grids", [[(1, 16, 16)], [(1, 2, 36), (1, 12, 18)], [(2, 4, 6)]])
def test_position_ids_match_hf(grids: list[tuple[int, int, int]]) -> None:
    ours = vision_position_ids(np.array(grids), merge_size=2)
    ref = get_vision_position_ids(torch.tensor(grids), 2).numpy()
    np.testing.assert_array_equal(ours, ref)
    sizes = [t * h * w for t, h, w in grids]
    assert ours.shape == (sum(sizes), 2)
    assert segment_ids(np.array(grids)).tolist() == [
        seg
        for seg, size in enumerate(s for (t, h, w) in grids for s in [h * w] * t)
        for _ in range(size)
    ]


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


def test_content_hash(preprocess_cfg: PreprocessConfig) -> None:
    original = Image.fromarray(skimage.data.astronaut())
    png = _encode(original, "PNG")
    from_png = content_hash(decode_image(png), preprocess_cfg, "enc-a")
    from_b64 = content_hash(decode_image(base64.b64encode(png).decode()), preprocess_cfg, "enc-a")
    assert from_png == from_b64
    assert content_hash(np.asarray(original), preprocess_cfg, "enc-a") == from_png
    other_pixels = PreprocessConfig(**{**preprocess_cfg.__dict__, "max_pixels": 448 * 448})
    assert content_hash(decode_image(png), other_pixels, "enc-a") != from_png
    assert content_hash(decode_image(png), preprocess_cfg, "enc-b") != from_png
    shifted = np.roll(np.asarray(original), 1, axis=1)
    assert content_hash(shifted, preprocess_cfg, "enc-a") != from_png
