"""Model families, one module each, picked by the checkpoint's ``config.json`` ``model_type``.

A lazy registry (as vLLM's model registry): a family's module is imported only when a
checkpoint of that family is opened. ``family_for`` is the one way the stages get one.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from orchestrator.families.base import (
    EncoderInput,
    GraphInput,
    GraphTarget,
    ImageLayout,
    ModelFamily,
    UnsupportedModel,
)
from orchestrator.model.checkpoint import Checkpoint, CheckpointError

_REGISTRY: dict[str, str] = {
    "qwen2_vl": "orchestrator.families.qwen2_vl:Qwen2VLFamily",
    "qwen2_5_vl": "orchestrator.families.qwen2_5_vl:Qwen2_5VLFamily",
    "qwen3_vl": "orchestrator.families.qwen3_vl:Qwen3VLFamily",
    "llava": "orchestrator.families.llava:LlavaFamily",
}
SUPPORTED = tuple(_REGISTRY)
"""``model_type`` values this project serves."""


def family_class(model_type: str) -> type[ModelFamily]:
    """The family class serving ``model_type``; :class:`UnsupportedModel` lists the others."""
    try:
        module, _, name = _REGISTRY[model_type].partition(":")
    except KeyError:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported families: "
            f"{', '.join(SUPPORTED)}"
        ) from None
    return getattr(importlib.import_module(module), name)


def family_for(model: str | Path | Checkpoint) -> ModelFamily:
    """Open (and validate) a checkpoint and return its family.

    Raises :class:`~orchestrator.model.checkpoint.CheckpointError` (``UnsupportedModel`` is
    one) with a message naming the file or the setting at fault.
    """
    checkpoint = model if isinstance(model, Checkpoint) else Checkpoint.open(model)
    cls = family_class(checkpoint.model_type)
    try:
        return cls(checkpoint)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{checkpoint.path}: not a usable {checkpoint.model_type} checkpoint: {exc!r}"
        ) from None


__all__ = [
    "SUPPORTED",
    "CheckpointError",
    "EncoderInput",
    "GraphInput",
    "GraphTarget",
    "ImageLayout",
    "ModelFamily",
    "UnsupportedModel",
    "family_class",
    "family_for",
]
