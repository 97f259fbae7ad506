"""What the chat and completions endpoints share in reading a request: the checkpoint's
sampling defaults, vLLM's own reading of the sampling fields, and the rule that a field
this server does not act on is refused by name, never silently dropped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from vllm.exceptions import VLLMError

from orchestrator.config import describe
from orchestrator.protocol import InvalidRequest, SamplingOptions, Tensors

GENERATION_DEFAULTS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
"""Sampling defaults a checkpoint's ``generation_config.json`` sets, as vLLM reads them."""

COMMON_FIELDS = frozenset(
    {
        # which model, how the prompt is tokenized, the answer's shape
        "model", "add_special_tokens", "stream", "stream_options", "request_id", "n",
        # vLLM's to_sampling_params reads them; SamplingOptions carries them
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
        "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens",
        "response_format", "structured_outputs",
        # vLLM's extension: the prompt's and the answer's token ids beside the text
        "return_token_ids",
        # what vllm serve does not act on either
        "user",
    }
)  # fmt: skip
"""Fields of both endpoints' requests this server acts on as ``vllm serve`` does."""


def parse_request(kind: type[BaseModel], body: Any) -> Any:
    """``body`` as vLLM's request model ``kind``, with vLLM's validators; ``InvalidRequest``
    saying what is wrong."""
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(describe(exc)) from None
    except (ValueError, VLLMError) as exc:
        raise InvalidRequest(str(exc)) from None


def generation_defaults(model: Path) -> dict[str, Any]:
    """The checkpoint's own sampling defaults (what ``vllm serve`` applies when a request
    leaves a parameter out); ``max_new_tokens`` becomes the default ``max_tokens``."""
    path = model / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    defaults = {k: config[k] for k in GENERATION_DEFAULTS if config.get(k) is not None}
    if config.get("max_new_tokens"):
        defaults["max_tokens"] = config["max_new_tokens"]
    return defaults


def check_supported(request: Any, served: frozenset[str], refusals: dict[str, Any]) -> None:
    """Refuse, by name, what this server would otherwise have to ignore: ``refusals`` maps
    a field to why it is refused (falsy: it is not), and any field of vLLM's request beyond
    ``served`` set to something but its default is refused too, so a new vLLM field is
    refused until it is served."""
    for name, why in refusals.items():
        if why:
            raise InvalidRequest(f"{name}: {why}")
    fields = type(request).model_fields
    # A field vLLM does not know at all, vllm serve ignores (its request model logs it).
    for name in sorted((request.model_fields_set & fields.keys()) - served - refusals.keys()):
        if getattr(request, name) != fields[name].get_default(call_default_factory=True):
            raise InvalidRequest(f"{name}: not supported by this server")


def common_refusals(request: Any) -> dict[str, Any]:
    """What neither endpoint serves, by field: beam search, log-probabilities of the
    prompt."""
    return {
        "prompt_logprobs": request.prompt_logprobs is not None and "not returned",
        "use_beam_search": request.use_beam_search and "beam search is not served here",
    }


def sampling(request: Any, asked: int | None, defaults: dict[str, Any]) -> SamplingOptions:
    """vLLM's own reading of the request's sampling fields (``to_sampling_params``, with
    the checkpoint's defaults), as the engine options the models take; ``asked`` is the
    request's ``max_tokens``, ``None`` to leave it to the model (what the context leaves)."""
    try:
        params = request.to_sampling_params(asked or 1 << 20, defaults)
    except (ValueError, VLLMError) as exc:  # vLLM's validation errors
        raise InvalidRequest(str(exc)) from None
    fields = set(SamplingOptions.model_fields) - {"n", "max_tokens", "structured_outputs"}
    options = {name: getattr(params, name) for name in fields}
    options["stop"] = list(params.stop or [])
    # response_format or structured_outputs, as vLLM read them into one constraint
    if (constraint := params.structured_outputs) is not None:
        options["structured_outputs"] = {
            f.name: getattr(constraint, f.name) for f in dataclasses.fields(constraint) if f.init
        }
    options["stop_token_ids"] = list(request.stop_token_ids or [])
    try:
        return SamplingOptions.model_validate({**options, "max_tokens": asked})
    except ValueError as exc:
        raise InvalidRequest(f"sampling parameters: {exc}") from None


def parallel_samples(inputs: Tensors, options: SamplingOptions, n: int) -> list[Tensors]:
    """``n`` answers to one prompt as vLLM's parallel sampling makes them: ``n`` requests
    of one answer each, the ``j``-th seeded ``seed + j`` when the request has a seed."""
    samples = []
    for j in range(n):
        child = (
            options
            if options.seed is None
            else options.model_copy(update={"seed": options.seed + j})
        )
        encoded = np.array([child.model_dump_json().encode()], dtype=np.object_)
        samples.append({**inputs, "sampling_parameters": encoded})
    return samples
