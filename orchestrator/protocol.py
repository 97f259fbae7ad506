"""Wire types exchanged between the stages (encoder -> prefill -> decode -> client).

Everything that crosses a process boundary is one of these pydantic models, serialised
as JSON inside a Triton BYTES tensor. Tensors themselves never ride this path except in
the ``inline`` transport, which exists for A/B comparison.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator.config import describe
from orchestrator.families.base import ImageLayout

Tensors = dict[str, np.ndarray]
"""A Triton model's inputs or outputs by name, as the stages and fronts pass them."""

PROBE_PARAMETER = "epd-probe"
"""Triton request parameter of a health probe: the runner answers it (the handler's
``check_health`` when it has one); it never reaches ``generate``."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NixlLocation(_Wire):
    """Where a NIXL consumer reads an embedding from (a region of the producer's pool)."""

    kind: Literal["nixl"] = "nixl"
    agent: str
    """NIXL agent name of the producer (unique per encoder process)."""
    metadata_addr: str
    """``host:port`` of the producer's side channel that serves its NIXL agent metadata."""
    addr: int
    """Start address of the region in the producer's registered DRAM pool."""
    length: int
    """Bytes of the region: header + payload + trailer (see ``orchestrator.transfer.nixl``)."""
    nonce: str
    """Hex token written around the payload; a mismatch means the slot was freed or reused."""

    @property
    def host(self) -> str:
        """The host a consumer dials for this location."""
        return self.metadata_addr.rsplit(":", 1)[0]


class MooncakeLocation(_Wire):
    """Where a Mooncake consumer reads an embedding from (a region of the producer's pool)."""

    kind: Literal["mooncake"] = "mooncake"
    session: str
    """``host:rpc_port`` of the producer's TransferEngine (P2P handshake, no metadata server)."""
    addr: int
    """Start address of the region in the producer's registered pool."""
    length: int
    """Bytes of the region: nonce + payload + nonce."""
    nonce: str
    """Hex token written around the payload; a mismatch means the slot was freed or reused."""

    @property
    def host(self) -> str:
        """The host a consumer dials for this location."""
        return self.session.rsplit(":", 1)[0]


class InlinePayload(_Wire):
    """The embedding bytes themselves (base64), for the inline A/B transport."""

    kind: Literal["inline"] = "inline"
    data_b64: str
    host: None = None
    """Nothing to dial: the payload is here."""


class EmbeddingHandle(_Wire):
    """Metadata-only reference to one image's vision embeddings held by an encoder."""

    handle_id: str
    """Unique id of this handle (also the NIXL notification that releases it)."""
    location: Annotated[
        NixlLocation | MooncakeLocation | InlinePayload, Field(discriminator="kind")
    ]
    shape: tuple[PositiveInt, PositiveInt]
    """(num_image_tokens, hidden_size) of the embeddings."""
    dtype: Literal["float32", "float16", "bfloat16"]
    grid_thw: tuple[PositiveInt, PositiveInt, PositiveInt] | None = None
    """(t, h, w) patch grid before merging, for families with grids (vLLM needs it for
    mRoPE positions); None for fixed-size families."""
    content_hash: str
    """Hash of decoded pixels + preprocessing parameters + encoder identity."""
    ttl_s: float
    """Seconds from issue, by the producer's own clock, after which it may reclaim the
    slot if nobody pulled it (no two hosts' clocks are compared; a reclaimed slot fails
    the consumer's nonce check)."""
    signature: str = ""
    """MAC of every other field by the issuing encoder (``orchestrator.auth``); prefill
    refuses a handle whose signature does not verify before touching its location."""

    @property
    def layout(self) -> ImageLayout:
        """What the image becomes in the prompt (rows = image tokens)."""
        return ImageLayout(tokens=self.shape[0], grid_thw=self.grid_thw)

    @property
    def nbytes(self) -> int:
        itemsize = 2 if self.dtype in ("float16", "bfloat16") else 4
        return self.shape[0] * self.shape[1] * itemsize


class EncodeResult(_Wire):
    """What the ``encode`` model answers: one handle per image, in request order."""

    handles: list[EmbeddingHandle]


class ReleaseRequest(_Wire):
    """Front -> encoder: handles whose request ended before prefill pulled them (a sibling
    image failed, the prompt did not fit, prefill failed): unpin them now, not at TTL."""

    handle_ids: list[str] = Field(default_factory=list, max_length=1024)
    request_id: str | None = None
    """Also every handle issued so far to the encode calls of this request: the ones whose
    answers never reached the front because it was cancelled meanwhile."""


class PrefillResult(_Wire):
    """What the ``prefill`` model answers: vLLM's params that let decode pull the KV."""

    kv_transfer_params: dict | None
    """Returned by the NixlConnector producer; ``None`` when KV transfer is off."""
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None = None
    """The prompt as prefill's engine took it, image placeholders expanded: sent only for
    families whose decode cannot be given images as metadata (LLaVA)."""


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraints of vLLM's ``StructuredOutputsParams``, of which a request sets one."""


class StructuredOutputs(_Wire):
    """vLLM's ``StructuredOutputsParams`` under the same names: one constraint the answer
    follows (guided decoding), and how strictly. The engine that samples the answer
    compiles it (xgrammar, or guidance for what xgrammar lacks) and refuses one it cannot
    compile with vLLM's message."""

    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)

    json_schema: str | dict | None = Field(default=None, alias="json")
    """A JSON schema the answer validates against (an object, or its text)."""
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    """The answer is one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF) grammar the answer is a sentence of."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's ``response_format: json_object``)."""
    structural_tag: str | None = None
    """vLLM's structural tag (JSON text): free text with constrained regions."""
    disable_any_whitespace: bool = False
    """Passed on as vLLM takes it (vLLM 0.32's backends read the engine's setting instead)."""
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        dumped = self.vllm_kwargs()
        kinds = [k for k in STRUCTURED_KINDS if dumped[k] is not None]
        if len(kinds) != 1:
            got = ", ".join(kinds) or "none"
            raise ValueError(f"set exactly one of {', '.join(STRUCTURED_KINDS)} (got {got})")
        return self

    def vllm_kwargs(self) -> dict:
        """Keyword arguments of vLLM's ``StructuredOutputsParams``."""
        return self.model_dump()


class SamplingOptions(_Wire):
    """User-facing sampling parameters (the ``sampling_parameters`` JSON input): vLLM's
    ``SamplingParams`` fields that apply to one streamed text answer, under the same names
    (as Triton's vllm_backend takes them). Fields that would need another output shape
    (``n`` > 1, the prompt's log-probabilities) are refused with a message, never ignored;
    vLLM checks the combination again when the engine gets the request."""

    max_tokens: int | None = Field(default=16, gt=0)
    """``None``: as many as the model's context leaves after the prompt (what vLLM's
    OpenAI server does without ``max_tokens``)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0 is greedy (vLLM's default is 1.0; ours keeps answers reproducible)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    """0 or -1 disable top-k."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, max_length=300
    )
    allowed_token_ids: list[int] | None = Field(default=None, max_length=4096)
    bad_words: list[str] | None = Field(default=None, max_length=64)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = Field(default=None, ge=-1)
    """Log-probabilities of each answer token and of the likeliest this many others (-1:
    the whole vocabulary), in the ``logprobs`` output (``return_logprobs``); the engine's
    ``max_logprobs`` bounds it (vLLM's default: 20)."""
    structured_outputs: StructuredOutputs | None = None
    """Guided decoding: the constraint the answer follows. An object, or its JSON text
    (what Triton's vllm_backend reads); ``guided_decoding``, vllm_backend's older name, is
    taken too."""
    n: Literal[1] = 1
    """One answer per request: ``text_output`` streams a single sequence."""

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _structured_from_text(cls, value: object) -> object:
        if isinstance(value, str | bytes):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        return value

    def vllm_kwargs(self) -> dict:
        """Keyword arguments of vLLM's ``SamplingParams`` for these options (the structured
        output constraint as ``StructuredOutputsParams``' own keyword arguments)."""
        kwargs = self.model_dump(exclude={"n"})
        kwargs["top_k"] = max(self.top_k, 0)
        kwargs["stop"] = self.stop or None
        kwargs["stop_token_ids"] = self.stop_token_ids or None
        return kwargs

    @classmethod
    def parse(cls, raw: str | bytes | None) -> SamplingOptions:
        """Parse the JSON input; raise ``InvalidRequest`` naming the bad field."""
        if raw is None or (isinstance(raw, bytes | str) and not raw.strip()):
            return cls()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidRequest("sampling_parameters must be a JSON object")
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        if "guided_decoding" in data:
            if data.get("structured_outputs") is not None:
                raise InvalidRequest(
                    "sampling_parameters: send structured_outputs or guided_decoding, not both"
                )
            data["structured_outputs"] = data.pop("guided_decoding")
        for name, why in _UNSUPPORTED_SAMPLING.items():
            if data.get(name) not in (None, 0, False):
                raise InvalidRequest(f"sampling_parameters.{name} is not supported: {why}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise InvalidRequest(f"invalid sampling_parameters: {describe(exc)}") from None


_UNSUPPORTED_SAMPLING = {
    "prompt_logprobs": "the prompt's log-probabilities are not returned",
    "best_of": "one answer per request",
}


class _PromptRequest(_Wire):
    """What every engine stage gets: the request's id and its prompt's tokens."""

    request_id: str
    prompt_token_ids: list[int]
    """The chat as the model's chat template renders it, tokenized once, by the front
    (``frontend.PromptBuilder``; each image's placeholder one token, expanded by vLLM): what
    vLLM's chat endpoint hands its engine. Engines do not tokenize it again."""


class PrefillRequest(_PromptRequest):
    """Front -> prefill: the prompt's tokens and where its image embeddings are."""

    handles: list[EmbeddingHandle] = Field(default_factory=list)


class PrefillDecodeRequest(_PromptRequest):
    """Front -> pd (E+PD): the prompt's tokens, where its image embeddings are, and how to
    sample; one engine prefills and streams the answer."""

    handles: list[EmbeddingHandle] = Field(default_factory=list)
    sampling: SamplingOptions
    return_token_ids: bool = False
    """Answer the tokens' ids too (``token_ids``; the engine's prompt in the first)."""


class DecodeRequest(_PromptRequest):
    """Front -> decode: the prompt's tokens, image layouts only (no embeddings) and the KV
    to pull; or, for a prompt decode prefills itself (``routing.max_local_prefill_tokens``),
    what pd gets: the prompt's tokens and where its image embeddings are."""

    prefilled_token_ids: list[int] | None = None
    """Prefill's prompt with each image's tokens in place, for families that need it
    (``PrefillResult.prompt_token_ids``)."""
    images: list[ImageLayout] = Field(default_factory=list)
    """Each image's token count and grid (from its handle): enough to place the image
    tokens and, for Qwen, the mRoPE positions; the KV itself arrives from prefill."""
    image_hashes: list[str] = Field(default_factory=list)
    """Content hashes of the images (from their handles): vLLM's identity for them."""
    sampling: SamplingOptions
    return_token_ids: bool = False
    """Answer the tokens' ids too (``token_ids``; the engine's prompt in the first)."""
    kv_transfer_params: dict | None = None
    """Where prefill holds the prompt's KV (vLLM's, from ``PrefillResult``); ``None``:
    decode prefills the prompt itself."""
    handles: list[EmbeddingHandle] = Field(default_factory=list)
    """Where the images' embeddings are, for a prompt decode prefills itself (none when
    prefill has the KV)."""

    @model_validator(mode="after")
    def _one_source_of_kv(self) -> DecodeRequest:
        if self.kv_transfer_params is None and self.images:
            raise ValueError("image layouts come with prefill's kv_transfer_params")
        if self.kv_transfer_params is not None and self.handles:
            raise ValueError("handles are for a prompt decode prefills itself, not with KV")
        return self

    abandon: bool = False
    """The request ended after prefill and before its first token: unless decode's engine
    already has it (then vLLM's own abort frees prefill's KV, or lets a READ in flight
    finish first), decode tells prefill's engine to free the KV it holds for it
    (``kv_transfer_params``), refuses the request should it still arrive, and answers
    nothing."""


class StageError(RuntimeError):
    """An error a client may see, of one kind in the taxonomy below.

    Each kind says whose fault it is, whether the same request may succeed if retried, and
    what it becomes at each edge: a Triton error code (``triton_code``), an HTTP status
    (``http_status``) and, between stages, the ``KIND: message`` text that rebuilds it on
    the caller's side. This class itself is ``INTERNAL``: a bug or an unexpected state here.
    """

    kind = "INTERNAL"
    """Wire name of the kind (the prefix of the message between stages)."""
    triton_code = "INTERNAL"
    """``pb_utils.TritonError`` code the model boundary answers with."""
    http_status = 500
    fault: Literal["client", "server"] = "server"
    retryable = False


class InvalidRequest(StageError):
    """The client sent something wrong; the same request will fail again."""

    kind = triton_code = "INVALID_ARG"
    http_status = 400
    fault = "client"


class TooLarge(InvalidRequest):
    """The client sent more than this deployment accepts (bytes, pixels, images, text)."""

    kind = "TOO_LARGE"
    http_status = 413


class Unauthenticated(InvalidRequest):
    """An internal stage was called without a valid deployment credential, or was handed
    a handle no encoder of this deployment signed. Nothing was dialled or allocated."""

    kind = "UNAUTHENTICATED"
    http_status = 401


class Unavailable(StageError):
    """A stage or resource is unavailable right now; retry later (maybe elsewhere)."""

    kind = triton_code = "UNAVAILABLE"
    http_status = 503
    retryable = True


class Overloaded(Unavailable):
    """The deployment is pushing back (encoder cache full of pinned embeddings, queues):
    the servers are healthy, the client should slow down."""

    kind = "OVERLOADED"
    http_status = 429


class DeadlineExceeded(Unavailable):
    """The request ran past its deadline, or a stream went quiet for longer than the idle
    timeout. Fails this request only: it never takes a server out of rotation."""

    kind = "DEADLINE_EXCEEDED"
    http_status = 504


class Cancelled(StageError):
    """The client went away (or cancelled); the work was stopped in every stage."""

    kind = triton_code = "CANCELLED"
    http_status = 499
    fault = "client"


class StageUnreachable(Unavailable):
    """A remote stage could not be reached or its stream broke (raised by the caller's
    client, never sent over the wire): the server is presumed down."""


class TransferError(Unavailable):
    """A handle could not be resolved (unknown, released, expired, or its host is gone)."""


_ERROR_KINDS: dict[str, type[StageError]] = {
    cls.kind: cls
    for cls in (
        StageError,
        InvalidRequest,
        TooLarge,
        Unauthenticated,
        Unavailable,
        Overloaded,
        DeadlineExceeded,
        Cancelled,
    )
}


def error_message(exc: StageError) -> str:
    """The text a stage sends: ``KIND: message``, so the kind survives gRPC streams
    (whose responses carry only an error string)."""
    return f"{exc.kind}: {exc}"


def error_from_message(message: str) -> StageError:
    """Rebuild the ``StageError`` a remote stage raised from its ``KIND: message`` text."""
    kind, sep, text = message.partition(": ")
    if sep and kind in _ERROR_KINDS:
        return _ERROR_KINDS[kind](text)
    return StageError(message)


class LastResponse(dict):
    """The tensors of a stream's last response (a plain dict to everyone else): the runner
    sends them with Triton's final flag instead of a data-less final after them, one
    message fewer per request on every hop, as Triton's vllm_backend does."""


M = TypeVar("M", bound=BaseModel)


def to_tensor(name: str, message: BaseModel) -> dict[str, np.ndarray]:
    """A wire message as the one-element BYTES tensor that carries it between stages."""
    return {name: np.array([message.model_dump_json().encode()], dtype=np.object_)}


def from_tensor(tensors: dict[str, np.ndarray], name: str, model: type[M]) -> M:
    """Parse the wire message in tensor ``name``; a malformed one is ``InvalidRequest``."""
    if name not in tensors or tensors[name].size != 1:
        raise InvalidRequest(f"input {name!r} must hold one JSON message")
    try:
        return model.model_validate_json(tensors[name].reshape(-1)[0])
    except ValueError as exc:
        raise InvalidRequest(f"malformed {name!r}: {exc}") from None
