"""Each family's encoder side equals HF's: pixels bit for bit with the checkpoint's own
processor (PIL backend), token counts with the processor's prompt expansion, and the
grid-derived graph inputs with transformers' own helpers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoProcessor

from orchestrator.families import SUPPORTED, UnsupportedModel, family_for
from orchestrator.families.qwen2_5_vl import window_layout
from orchestrator.families.qwen2_vl import smart_resize, vision_position_ids
from orchestrator.families.qwen3_vl import pos_embed_taps
from tests.conftest import FAMILIES
from tests.unit.conftest import PHOTO_NAMES, photo_named


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, hub_checkpoint):
    return family_for(hub_checkpoint(request.param))


@pytest.fixture(scope="module")
def hf_pil(family):
    return AutoImageProcessor.from_pretrained(family.checkpoint.path, backend="pil")


@pytest.fixture(scope="module")
def hf_processor(family):
    """What vLLM loads (the default backend) with the tokenizer: expands placeholders."""
    return AutoProcessor.from_pretrained(family.checkpoint.path)


def test_families_are_the_issue_s_four():
    assert set(SUPPORTED) == set(FAMILIES)


@pytest.mark.parametrize("name", PHOTO_NAMES)
def test_pixels_are_bit_exact_with_the_hf_pil_processor(family, hf_pil, name):
    image = photo_named(name)
    ours = family.encoder_input(image)
    ref = hf_pil(images=[image], return_tensors="np")
    pixels = ours.feeds["pixel_values"]
    assert pixels.dtype == np.float32 and pixels.shape == ref["pixel_values"].shape
    np.testing.assert_array_equal(pixels, ref["pixel_values"])
    if "image_grid_thw" in ref:
        assert ours.layout.grid_thw == tuple(ref["image_grid_thw"][0])
    assert family.image_layout(image.width, image.height) == ours.layout


@pytest.mark.parametrize("name", ["astronaut", "tiny_12x9", "wide_900x40", "large_1000x700"])
def test_image_tokens_are_what_the_processor_expands_to(family, hf_processor, name):
    """The prompt's placeholder becomes exactly ``layout.tokens`` image tokens."""
    image = photo_named(name)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    prompt = hf_processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = hf_processor(text=[prompt], images=[image], return_tensors="np")["input_ids"][0]
    tokens = family.image_layout(image.width, image.height).tokens
    assert int((ids == family.image_token_id).sum()) == tokens


def test_a_chats_tokens_are_the_processors_with_each_placeholder_expanded(family, hf_processor):
    """What ``/tokenize`` answers for a chat with images: our template's ids with each
    image's placeholder repeated for its tokens equal the HF processor's (what vLLM's
    renderer hands the engine)."""
    from orchestrator.frontend import PromptBuilder
    from orchestrator.openai_server.tokens import expand_images

    images = [photo_named("astronaut"), photo_named("tiny_12x9")]
    content = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    messages = [{"role": "user", "content": content}]
    prompt = hf_processor.apply_chat_template(messages, add_generation_prompt=True)
    expected = hf_processor(
        text=[prompt], images=images, add_special_tokens=False, return_tensors="np"
    )["input_ids"][0].tolist()
    ours = PromptBuilder(family.checkpoint.path, max_model_len=4096).render_now(messages)
    tokens = [family.image_layout(i.width, i.height).tokens for i in images]
    assert expand_images(ours.token_ids, family.image_token_id, tokens) == expected


def test_graph_inputs_cover_the_feeds(family):
    feeds = family.example_input().feeds
    assert [i.name for i in family.graph_inputs] == list(feeds)
    for spec in family.graph_inputs:
        array = feeds[spec.name]
        assert array.dtype == np.dtype(spec.dtype) and array.ndim == len(spec.dims)
        assert all(d in (-1, n) for d, n in zip(spec.dims, array.shape, strict=True))


def test_the_model_sized_pool_holds_the_largest_image(family):
    from orchestrator.transfer import pool_bytes_for

    one = family.max_image_bytes()
    assert pool_bytes_for(None, one) >= 8 * one
    with pytest.raises(ValueError, match="cannot hold one image"):
        pool_bytes_for(one // 2, one)


# Qwen: resize rule, rotary positions, windows (2.5), learned position taps (3).


def _qwen(hub_checkpoint, name: str = "qwen2_vl"):
    return family_for(hub_checkpoint(name))


@pytest.mark.parametrize(
    "size", [(30, 500), (500, 30), (1, 150), (56, 56), (224, 224), (225, 224), (4000, 3000)]
)
def test_smart_resize_bounds(size, hub_checkpoint):
    cfg = _qwen(hub_checkpoint).image_settings
    height, width = smart_resize(*size, cfg)
    assert height % 28 == 0 and width % 28 == 0
    assert cfg.min_pixels <= height * width <= cfg.max_pixels


def test_an_image_beyond_the_family_s_limits_says_why(hub_checkpoint):
    with pytest.raises(ValueError, match="aspect ratio 201.0 exceeds 200 \\(201x1\\)"):
        _qwen(hub_checkpoint).image_layout(201, 1)


@pytest.mark.parametrize("grid", [(1, 16, 16), (1, 2, 36), (2, 4, 6)])
def test_position_ids_match_hf(grid):
    from transformers.vision_utils import get_vision_position_ids

    ref = get_vision_position_ids(torch.tensor([grid]), 2).numpy()
    np.testing.assert_array_equal(vision_position_ids(grid, merge_size=2), ref)


@pytest.mark.parametrize("grid", [(1, 16, 16), (1, 2, 64), (1, 4, 6), (1, 24, 22), (1, 8, 8)])
def test_windows_are_hf_s_windows(grid):
    """Each row of ``window_index`` (pads dropped) is one of HF's windows, in HF's order,
    and ``window_inverse`` puts every patch back where it came from."""
    from transformers.vision_utils import get_vision_window_index

    index, inverse = window_layout(grid, merge_size=2, window_units=4)
    units, cu = get_vision_window_index(torch.tensor([grid]), 2, 112, 14)
    hf_order = (units[:, None] * 4 + torch.arange(4)).reshape(-1).numpy()
    bounds = cu.tolist()
    hf_windows = [hf_order[a:b].tolist() for a, b in zip(bounds, bounds[1:], strict=False)]
    n = grid[0] * grid[1] * grid[2]
    assert [row[row < n].tolist() for row in index] == hf_windows
    np.testing.assert_array_equal(index.reshape(-1)[inverse], np.arange(n))


@pytest.mark.parametrize("grid", [(1, 16, 16), (1, 2, 56), (1, 4, 6), (1, 64, 48)])
def test_position_taps_match_hf(grid):
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    index, weight = pos_embed_taps(grid, side=8, merge_size=2)
    ref_index, ref_weight = get_vision_interpolation_indices_and_weights(
        torch.tensor([grid]), 8, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    table = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)).numpy()
    ours = (table[index] * weight[..., None]).sum(1)
    ref = (table[ref_index.numpy()] * ref_weight.numpy()[..., None]).sum(1)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)


# LLaVA: CLIP's resize + centre crop, and what it refuses.


def test_center_crop_pads_like_hf_when_the_crop_is_larger():
    from transformers import CLIPImageProcessorPil

    from orchestrator.families.llava import ClipImageSettings, clip_pixels

    raw = {"size": {"shortest_edge": 90}, "crop_size": {"height": 112, "width": 112}}
    raw["do_center_crop"] = True
    image = Image.fromarray(skimage.data.chelsea())
    ours = clip_pixels(image, ClipImageSettings.from_processor(raw, "test"))
    ref = CLIPImageProcessorPil(**raw)(images=[image], return_tensors="np")["pixel_values"][0]
    np.testing.assert_array_equal(ours, ref)


def _with_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition("__")
        (config[section] if section else config)[field] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_llava_with_another_tower_is_refused(hub_checkpoint, tmp_path):
    path = _with_config(
        hub_checkpoint("llava"), tmp_path / "m", vision_config__model_type="siglip_vision_model"
    )
    with pytest.raises(UnsupportedModel, match="'siglip_vision_model' vision tower"):
        family_for(path)


def test_an_unsupported_family_lists_the_supported_ones(hub_checkpoint, tmp_path):
    path = _with_config(hub_checkpoint("qwen2_vl"), tmp_path / "m", model_type="gemma3")
    with pytest.raises(UnsupportedModel, match="'gemma3' is not supported; supported families: "):
        family_for(path)
