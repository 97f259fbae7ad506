"""Random-weight Qwen2-VL checkpoints built offline, for tests and CPU benchmarks.

No weights can be downloaded here, and the serving stack only needs a model of the right
*family* (same processor, same vision/text plumbing in vLLM), not a useful one. Everything is
derived from ``seed`` so that two builds give byte-identical weights, which lets encoder
identities (weight hashes) be compared across processes and machines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Profile = Literal["tiny", "bench", "wide"]

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = (
    range(len(SPECIAL_TOKENS))
)
VOCAB_SIZE = 512

# Qwen-style template: a default system turn, images/videos as vision_start/pad/vision_end.
CHAT_TEMPLATE = (
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
    """Sizes that differ between profiles."""

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


def build_model(out_dir: Path, profile: Profile = "tiny", seed: int = 0) -> Path:
    """Write a loadable random-weight Qwen2-VL checkpoint to ``out_dir`` and return it.

    The directory holds config, safetensors weights, generation config, tokenizer and
    processor configs, so both ``vllm.LLM(model=out_dir)`` and ``AutoProcessor`` load it
    without network access.
    """
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    spec = _PROFILES[profile]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    config = Qwen2VLConfig(
        text_config={
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
            },
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": IM_END_ID,
            "pad_token_id": ENDOFTEXT_ID,
        },
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
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        do_sample=False,
    ).save_pretrained(out_dir)

    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=spec.max_pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=spec.max_pixels)
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=_build_tokenizer(),
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    (out_dir / "epd_model.json").write_text(
        json.dumps({"family": "qwen2_vl-random", "profile": profile, "seed": seed}, indent=2)
    )
    return out_dir


def _build_tokenizer():
    """Train a 512-token byte-level BPE on the built-in corpus (deterministic, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
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
