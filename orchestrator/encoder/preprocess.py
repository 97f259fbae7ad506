"""Image decoding and Qwen2-VL preprocessing in plain numpy + Pillow.

The encoder stage must not import transformers/torch just to turn bytes into patches, yet its
output has to be what the model's HF image processor (PIL backend) produces, bit for bit, or
the embeddings it ships would differ from what vLLM computes from pixels. The arithmetic below
therefore follows HF's order of operations exactly (PIL resize, float64 rescale then float32
normalize, HF's patch order). Decoding mirrors vLLM's own image loading (EXIF orientation,
transparency over white) so an EPD request sees the same pixels as a plain vLLM server.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
"""Decoded-size cap (checked from the header, before decoding) against decompression bombs."""

_MAGIC = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
)
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PreprocessConfig:
    """Everything that determines ``preprocess``'s output (and hence part of the cache key)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    image_mean: tuple[float, float, float] = _OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = _OPENAI_CLIP_STD
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this, so patches merge into whole tokens."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PreprocessConfig:
        """Read the image processor settings saved next to a checkpoint.

        Accepts both layouts transformers writes: ``preprocessor_config.json`` and the
        ``image_processor`` section of ``processor_config.json``.
        """
        model_dir = Path(model_dir)
        legacy = model_dir / "preprocessor_config.json"
        if legacy.exists():
            raw = json.loads(legacy.read_text())
        else:
            raw = json.loads((model_dir / "processor_config.json").read_text())["image_processor"]
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if not raw.get(flag, True):
                raise ValueError(f"{model_dir}: {flag}=false is not supported by this preprocessor")
        size = raw.get("size") or {}  # {shortest,longest}_edge; older files: {min,max}_pixels
        return cls(
            patch_size=int(raw.get("patch_size", cls.patch_size)),
            merge_size=int(raw.get("merge_size", cls.merge_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", cls.temporal_patch_size)),
            min_pixels=int(
                raw.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
            ),
            max_pixels=int(
                raw.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
            ),
            image_mean=tuple(float(v) for v in raw.get("image_mean", _OPENAI_CLIP_MEAN)),
            image_std=tuple(float(v) for v in raw.get("image_std", _OPENAI_CLIP_STD)),
            resample=int(raw.get("resample", cls.resample)),
            rescale_factor=float(raw.get("rescale_factor", cls.rescale_factor)),
        )

    def canonical_json(self) -> str:
        """Stable text form, for hashing."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


def decode_image(data: bytes | str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode JPEG/PNG/WebP bytes, or base64 text of them (data URLs too), to an RGB image.

    Raises ``ValueError`` for anything that is not a well-formed image of an allowed format or
    whose header claims more than ``max_pixels`` pixels.
    """
    raw = _as_image_bytes(data)
    try:
        img = Image.open(io.BytesIO(raw), formats=ALLOWED_FORMATS)
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a decodable {'/'.join(ALLOWED_FORMATS)} image: {e}") from e
    width, height = img.size
    if width <= 0 or height <= 0 or width * height > max_pixels:
        raise ValueError(
            f"image is {width}x{height} = {width * height} pixels, limit is {max_pixels}"
        )
    try:
        img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"corrupt {img.format} image: {e}") from e
    # Like vLLM: honour EXIF orientation, but a broken EXIF block leaves the image as stored.
    with contextlib.suppress(Exception):
        img = ImageOps.exif_transpose(img)
    return _to_rgb(img)


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


def smart_resize(height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    """Target (height, width): multiples of ``cfg.factor``, area within [min, max] pixels.

    Same rounding as HF's Qwen2-VL ``smart_resize``; grid sizes (and so token counts) depend
    on it, so it must not drift.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds 200")
    factor = cfg.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > cfg.max_pixels:
        beta = math.sqrt((height * width) / cfg.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(img: Image.Image, cfg: PreprocessConfig) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid ``preprocess`` will produce, without doing the work."""
    height, width = smart_resize(img.height, img.width, cfg)
    return 1, height // cfg.patch_size, width // cfg.patch_size


def preprocess(img: Image.Image, cfg: PreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Resize, normalize and patchify one image.

    Returns ``pixel_values`` float32 ``[grid_h * grid_w, cfg.patch_dim]`` and the grid
    ``(1, grid_h, grid_w)``, laid out exactly as HF's Qwen2-VL image processor lays them out.
    """
    if img.mode != "RGB":
        img = img.convert("RGB")
    height, width = smart_resize(img.height, img.width, cfg)
    resized = img.resize((width, height), resample=cfg.resample)
    pixels = np.asarray(resized, dtype=np.uint8)
    # One float32 value per (channel, byte) computed with HF's arithmetic (float64 rescale,
    # float32 normalize), so a table lookup reproduces it bit for bit at a fraction of the cost.
    scaled = (np.arange(256, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
    lut = (scaled[None, :] - mean) / std
    chw = np.stack([lut[c][pixels[..., c]] for c in range(3)])

    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = chw.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    pixel_values = np.ascontiguousarray(patches.reshape(grid_h * grid_w, cfg.patch_dim))
    return pixel_values, (1, grid_h, grid_w)


def vision_position_ids(grid_thw: np.ndarray | tuple[int, int, int], merge_size: int) -> np.ndarray:
    """(h, w) rotary positions of every patch, int64 ``[sum(t*h*w), 2]``.

    Patches are ordered merge-block by merge-block (as ``preprocess`` emits them), so the
    position of patch i is not simply ``divmod(i, w)``. This is the data-dependent part of
    Qwen2-VL's vision forward that cannot live in a static ONNX graph.
    """
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    out = []
    for t, h, w in grids.tolist():
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge_size, merge_size, w // merge_size, merge_size)
        hpos = hpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def segment_ids(grid_thw: np.ndarray | tuple[int, int, int]) -> np.ndarray:
    """Attention segment of every patch, int64 ``[sum(t*h*w)]``: one per image frame.

    Patches attend only within their segment, which lets several images share one call.
    """
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    sizes = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)


def content_hash(image: Image.Image | np.ndarray, cfg: PreprocessConfig, encoder_id: str) -> str:
    """Cache key of an image's embeddings: decoded RGB pixels + preprocessing + encoder.

    Two requests share embeddings only if all three agree, independent of how the image was
    transported (PNG vs base64 vs a re-encoded lossless copy).
    """
    if isinstance(image, Image.Image):
        # Same conversion as ``preprocess``, so equal hashes imply equal pixel_values.
        pixels = np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)
    else:
        pixels = np.asarray(image)
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"expected uint8 [H, W, 3] pixels, got {pixels.dtype} {pixels.shape}")
    h = hashlib.sha256()
    h.update(b"epd-image-v1\0")
    h.update(f"{pixels.shape[0]}x{pixels.shape[1]}\0".encode())
    h.update(np.ascontiguousarray(pixels).data)
    h.update(cfg.canonical_json().encode() + b"\0")
    h.update(encoder_id.encode())
    return h.hexdigest()
