"""Random-weight checkpoints of every supported family, built offline, for tests and CPU
benchmarks.

No weights can be downloaded here, and the serving stack only needs a model of the right
*family* (same processor, same vision/text plumbing in vLLM), not a useful one. Each builder
uses the stock ``transformers`` classes of its family, so the checkpoint is laid out exactly
as ``save_pretrained`` (and so a hub download) lays it out. Everything is derived from
``seed`` so that two builds give byte-identical weights, which lets encoder identities
(weight hashes) be compared across processes and machines.

``hub_layout=True`` writes what a user downloads: bf16 weights in several safetensors shards
with an index, beside the processor, tokenizer and chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Profile = Literal["tiny", "bench", "wide"]
Family = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"]

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = (
    range(len(QWEN_SPECIAL_TOKENS))
)
LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID, LLAVA_IMAGE_ID = range(len(LLAVA_SPECIAL_TOKENS))
VOCAB_SIZE = 512

# Qwen-style template: a default system turn, images/videos as vision_start/pad/vision_end.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# LLaVA-1.5-style template: "USER: <image>\n... ASSISTANT:", one <image> per image part.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}"
    "{{ '\n' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Built-in training text for the byte-level BPE: enough distinct words for ~250 merges.
_CORPUS = """\
You are a helpful assistant. Describe the image in one sentence.
What is shown in this picture? The picture shows a cat sitting on a chair near a window.
An astronaut in a white suit stands in front of a flag. A cup of coffee rests on a saucer.
The quick brown fox jumps over the lazy dog while the sun sets behind the hills.
Encoding, prefill and decode run on separate workers; the encoder turns pixels into
embeddings, the prefill worker builds the key value cache, and the decoder streams tokens.
system user assistant image video text question answer color shape size number count
red green blue yellow black white orange purple small large left right top bottom middle
Please answer briefly. Thank you! How many objects are there? There are three objects.
The weather is nice today, and the children are playing in the garden with their friends.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _
"""


@dataclass(frozen=True)
class _Spec:
    """Sizes of the Qwen2-VL profiles."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: int
    max_pixels: int
    vision_init_std: float
    """Small enough that fp32 rounding stays ~1e-6 relative through the tower (at 0.3 a
    10-block, 512-wide tower saturates its softmaxes and fp32 drifts 1% from fp64), large
    enough that image embeddings change the greedy tokens."""
    text_hidden: int = 128
    """Width of the text model, hence of every image embedding row (the merger's output)."""
    text_heads: int = 2
    text_layers: int = 2
    text_intermediate: int = 256
    max_position_embeddings: int = 2048
    """The context vLLM serves (``max_model_len`` unless the topology sets one)."""

    @property
    def mrope_section(self) -> list[int]:
        """Qwen2-VL's (t, h, w) split of half a head's rotary dims, in its 2:3:3 ratio."""
        half = self.text_hidden // self.text_heads // 2
        return [half // 4, 3 * half // 8, 3 * half // 8]


_PROFILES: dict[str, _Spec] = {
    "tiny": _Spec(
        depth=2, embed_dim=64, num_heads=2, mlp_ratio=2, max_pixels=224 * 224, vision_init_std=0.3
    ),
    # Heavy vision tower, same tiny text model: encoding dominates a request on CPU (2-core dev
    # box: ~0.4-0.6 s to encode 448x448 = 1024 patches vs ~30 ms for prefill + 16 tokens).
    "bench": _Spec(
        depth=10,
        embed_dim=512,
        num_heads=8,
        mlp_ratio=4,
        max_pixels=448 * 448,
        vision_init_std=0.06,
    ),
    # Real-VLM-sized embeddings at CPU cost: a 896x896 image is 1024 tokens x 2048 floats =
    # 8 MiB (Qwen2-VL-7B: 3584 wide in bf16), from a light tower into a one-layer text model
    # with 128-wide heads. What moving embeddings costs shows here, not in the other two.
    "wide": _Spec(
        depth=2,
        embed_dim=64,
        num_heads=2,
        mlp_ratio=2,
        max_pixels=896 * 896,
        vision_init_std=0.3,
        text_hidden=2048,
        text_heads=16,
        text_layers=1,
        text_intermediate=512,
        max_position_embeddings=4096,
    ),
}
MIN_PIXELS = 56 * 56
# Text-model init, wider than HF's 0.02 default: with 0.02 the random model ignores the image
# and repeats one token, so a wrong embedding would go unnoticed; at 0.3 greedy tokens depend
# on the image and top-1 logit gaps are large enough that fp32 noise does not flip them.
TEXT_INIT_STD = 0.3
VISION_INIT_STD = 0.3
"""Vision init of the small towers of the newer families (as the ``tiny`` profile's)."""
HUB_SHARD_BYTES = "400KB"
"""Shard size of ``hub_layout`` checkpoints: several shards even for a tiny model, so the
index and the vision weights spread over shards are exercised like a real download's."""


def build_model(
    out_dir: Path,
    profile: Profile = "tiny",
    seed: int = 0,
    family: Family = "qwen2_vl",
    hub_layout: bool = False,
) -> Path:
    """Write a loadable random-weight checkpoint of ``family`` to ``out_dir``; return it.

    The directory holds config, safetensors weights, generation config, tokenizer, processor
    config and chat template, so ``vllm.LLM(model=out_dir)`` and ``AutoProcessor`` load it
    without network access. Profiles other than ``tiny`` exist for Qwen2-VL only.
    """
    import torch

    if family != "qwen2_vl" and profile != "tiny":
        raise ValueError(f"profile {profile!r} exists for qwen2_vl only, not {family!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, processor, generation = _BUILDERS[family](_PROFILES[profile])
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = model().eval()
    if hub_layout:
        model = model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        model.save_pretrained(out_dir, max_shard_size=HUB_SHARD_BYTES)
    else:
        model.save_pretrained(out_dir)
    if family == "llava":
        _rename_weights(out_dir, "vision_tower.", "vision_tower.vision_model.")
    generation.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    (out_dir / "epd_model.json").write_text(
        json.dumps(
            {"family": family, "profile": profile, "seed": seed, "hub_layout": hub_layout},
            indent=2,
        )
    )
    return out_dir


def _rename_weights(out_dir: Path, prefix: str, replacement: str) -> None:
    """Rename weights in place, in every shard and the index.

    transformers 5.19 writes a CLIP tower without its ``vision_model.`` level, a layout that
    neither hub checkpoints (``llava-hf/*``) nor vLLM 0.32's loader use.
    """
    from safetensors.torch import load_file, save_file

    def rename(name: str) -> str:
        return replacement + name[len(prefix) :] if name.startswith(prefix) else name

    for shard in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({rename(k): v for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_Built = tuple[Callable[[], Any], Any, Any]
"""(model factory run under the seeded RNG, processor, generation config)."""


def _qwen_text_config(spec: _Spec, **rope: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.text_hidden,
        "intermediate_size": spec.text_intermediate,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": 1,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": TEXT_INIT_STD,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": spec.mrope_section,
            **rope,
        },
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }


_QWEN_TOKENS = {
    "image_token_id": IMAGE_PAD_ID,
    "video_token_id": VIDEO_PAD_ID,
    "vision_start_token_id": VISION_START_ID,
    "vision_end_token_id": VISION_END_ID,
    "tie_word_embeddings": False,
}


def _qwen_generation():
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        do_sample=False,
    )


def _qwen_processor(processor_cls, video_cls, **image_settings: Any):
    from transformers import Qwen2VLImageProcessorPil

    pixels = {k: image_settings.pop(k) for k in ("min_pixels", "max_pixels")}
    return processor_cls(
        image_processor=Qwen2VLImageProcessorPil(**pixels, **image_settings),
        tokenizer=_qwen_tokenizer(),
        video_processor=video_cls(**pixels, **image_settings),
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def _qwen2_vl(spec: _Spec) -> _Built:
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    config = Qwen2VLConfig(
        text_config=_qwen_text_config(spec),
        vision_config={
            "depth": spec.depth,
            "embed_dim": spec.embed_dim,
            "num_heads": spec.num_heads,
            "mlp_ratio": spec.mlp_ratio,
            "hidden_size": spec.text_hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": spec.vision_init_std,
        },
        **_QWEN_TOKENS,
    )
    processor = _qwen_processor(
        Qwen2VLProcessor, Qwen2VLVideoProcessor, min_pixels=MIN_PIXELS, max_pixels=spec.max_pixels
    )
    model = lambda: Qwen2VLForConditionalGeneration(config).float()  # noqa: E731
    return model, processor, _qwen_generation()


def _small_tower(spec: _Spec, **family_settings: Any) -> dict[str, Any]:
    """The vision config of the newer Qwen families' test towers: 64 wide, 2 heads."""
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": spec.text_hidden,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": VISION_INIT_STD,
        **family_settings,
    }


def _qwen2_5_vl(spec: _Spec) -> _Built:
    """Four vision blocks, two windowed and two full (as 7B's 32 blocks: full every 8th)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLVideoProcessor,
    )

    config = Qwen2_5_VLConfig(
        text_config=_qwen_text_config(spec),
        vision_config=_small_tower(
            spec, depth=4, patch_size=14, window_size=112, fullatt_block_indexes=[1, 3]
        ),
        **_QWEN_TOKENS,
    )
    processor = _qwen_processor(
        Qwen2_5_VLProcessor, Qwen2VLVideoProcessor, min_pixels=MIN_PIXELS, max_pixels=336 * 336
    )
    model = lambda: Qwen2_5_VLForConditionalGeneration(config).float()  # noqa: E731
    return model, processor, _qwen_generation()


def _qwen3_vl(spec: _Spec) -> _Built:
    """Patch 16, learned position grid 8x8 (interpolated per image), DeepStack features
    from the first two of three vision blocks, interleaved mRoPE in the text model."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    text = _qwen_text_config(spec, mrope_interleaved=True)
    text.update(head_dim=spec.text_hidden // spec.text_heads, rms_norm_eps=1e-6)
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=_small_tower(
            spec,
            depth=3,
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        **_QWEN_TOKENS,
    )
    processor = _qwen_processor(
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
        min_pixels=64 * 64,
        max_pixels=256 * 256,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    model = lambda: Qwen3VLForConditionalGeneration(config).float()  # noqa: E731
    return model, processor, _qwen_generation()


def _llava(spec: _Spec) -> _Built:
    """LLaVA-1.5's shape: a CLIP tower (112 px, patch 14: 64 image tokens after dropping
    CLS), features from the second-to-last layer, a two-layer MLP projector, a Llama."""
    from transformers import (
        CLIPImageProcessorPil,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    image_size = 112
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": 14,
            "projection_dim": 64,
            "hidden_act": "quick_gelu",
            "initializer_range": VISION_INIT_STD,
            "initializer_factor": 1.0,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": spec.text_hidden,
            "intermediate_size": spec.text_intermediate,
            "num_hidden_layers": spec.text_layers,
            "num_attention_heads": spec.text_heads,
            "num_key_value_heads": 1,
            "head_dim": spec.text_hidden // spec.text_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "initializer_range": TEXT_INIT_STD,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
        },
        image_token_index=LLAVA_IMAGE_ID,
        image_seq_length=(image_size // 14) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        ),
        tokenizer=_llava_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    generation = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model = lambda: LlavaForConditionalGeneration(config).float()  # noqa: E731
    return model, processor, generation


_BUILDERS: dict[str, Callable[[_Spec], _Built]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "llava": _llava,
}


def _bpe(special_tokens: tuple[str, ...], bos: str | None = None):
    """A 512-token byte-level BPE trained on the built-in corpus (deterministic, offline);
    with ``bos``, every encoding starts with it (as Llama's tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    return tok


def _qwen_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_bpe(QWEN_SPECIAL_TOKENS),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=2048,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    )


def _llava_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_bpe(LLAVA_SPECIAL_TOKENS, bos="<s>"),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=2048,
        extra_special_tokens={"image_token": "<image>"},
    )
