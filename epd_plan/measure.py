"""``epd plan profile``: measure each stage on this machine and write its profile.

Two parts, one after the other so they never share the cores:

1. **The engine alone** (one vLLM engine with the deployment's engine arguments, nothing
   else running): prompts of several lengths in batches, prefilled with one output token,
   and batches of sequences decoding at two context lengths -- the prefill and decode step
   costs, fitted to the samples.
2. **The deployment** (E/P/D on free local ports, traces on): images of each size and
   text-only requests are sent one at a time through ``epd``, then the same images again
   (answered by the encoder's cache); the traces give each encode call's own time (the
   ``encode`` span on the encoder, for an image encoded and for one the cache answered)
   and what every hop adds around the stages (``call X`` minus ``X``, the embedding pull,
   the decode side's first token, what the front adds), and the gaps between tokens at
   the client, one request alone and several at once, against the engine's own steps,
   what serving a step and each sequence's token through Triton adds -- the encode and
   hops profiles.

The second part also notes how many cores the encoder keeps busy while it works (its
server's CPU over the time the encode calls spent there): what it takes from the engine
on one box.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from epd_bench.idle import tree_cpu_s
from epd_plan.profile import (
    DecodeProfile,
    DecodeSample,
    EncodeProfile,
    EncodeSample,
    HopsProfile,
    Machine,
    PrefillProfile,
    PrefillSample,
    fit,
    now,
)
from orchestrator.config import Topology, default_topology


@dataclass(frozen=True)
class Sweep:
    """What ``epd plan profile`` measures."""

    sizes: tuple[tuple[int, int], ...] = ((224, 224), (448, 448), (896, 896))
    images_per_size: int = 6
    prompt_tokens: tuple[int, ...] = (16, 64, 256)
    prefill_batches: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_contexts: tuple[int, ...] = (32, 256)
    decode_tokens: int = 24
    repeats: int = 2

    @classmethod
    def quick(cls) -> Sweep:
        """Fewest samples that still fit every coefficient (for tests)."""
        return cls(
            sizes=((224, 224), (448, 448)),
            images_per_size=3,
            prompt_tokens=(16, 1024),  # a span whose token cost stands out of the noise
            prefill_batches=(1, 2),
            decode_batches=(1, 4),
            decode_contexts=(32, 256),
            decode_tokens=12,
            repeats=1,
        )


def _photo(width: int, height: int, serial: int) -> bytes:
    from epd_bench.load import PHOTOS
    from epd_bench.photos import photo_variant

    return photo_variant(PHOTOS[serial % len(PHOTOS)], serial, (width, height), quality=90)


def _median(values: list[float], what: str) -> float:
    if not values:
        raise RuntimeError(f"the traces have no {what}: is tracing on in every server?")
    return statistics.median(values)


def _fit_encode(samples: list[EncodeSample], what: str) -> list[float]:
    """Per image and per megapixel of an encode call, fitted to its spans."""
    if not samples:
        raise RuntimeError(f"the traces have no encode calls of {what}")
    return fit([[1.0, s.width * s.height / 1e6] for s in samples], [s.latency_s for s in samples])


STEP_BATCH = 4
"""Text-only requests sent at once to measure what serving adds per sequence of a step."""


def _gaps_together(samples: list) -> tuple[list[float], int]:
    """The gaps between tokens of ``samples`` (started together) while the most of them
    were decoding at once, and how many that was: steps of the batch, not of its
    stragglers (the stages may stagger the requests' starts)."""
    spans = [(s.start + s.piece_times[0], s.start + s.piece_times[-1]) for s in samples]
    by_width: dict[int, list[float]] = {}
    for s in samples:
        times = [s.start + t for t in s.piece_times]
        for a, b in zip(times, times[1:], strict=False):
            mid = (a + b) / 2
            width = sum(1 for lo, hi in spans if lo <= mid <= hi)
            by_width.setdefault(width, []).append(b - a)
    widest = max(by_width)
    return by_width[widest], widest


def serving_overheads(
    alone_gap_s: float, batch_gap_s: float, batch: int, decode: DecodeProfile
) -> tuple[float, float]:
    """What serving adds to an engine step, per step and per sequence in it: the gaps
    between tokens at the client (one request alone, ``batch`` at once) less the engine's
    own decode step at those batch sizes, fitted as ``step + per_seq * batch``."""
    alone = alone_gap_s - decode.base_s - decode.per_seq_s
    if batch < 2:
        return max(0.0, alone), 0.0
    together = batch_gap_s - decode.base_s - decode.per_seq_s * batch
    per_seq = max(0.0, (together - alone) / (batch - 1))
    return max(0.0, alone - per_seq), per_seq


async def _send_all(
    url: str, requests: list[tuple[tuple[int, int], bytes | None]], rounds: int
) -> tuple[list, list[float], tuple[list[float], int]]:
    """Each request alone (concurrency 1), then ``rounds`` of ``STEP_BATCH`` text-only
    requests at once; returns (size, start_ns, end_ns) per lone request, the gaps between
    the tokens of the lone text-only ones, and those of the batches with as many decoding
    at once as ever were (and that count)."""
    import itertools

    from tritonclient.grpc.aio import InferenceServerClient

    from epd_bench.load import LoadRequest, stream_request

    sampling = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    windows, gaps = [], []
    async with InferenceServerClient(url) as client:
        for i, (size, image) in enumerate(requests):
            request = LoadRequest(
                "image" if image else "text", f"Describe #{i}.", (image,) if image else ()
            )
            start = time.time_ns()
            sample = await stream_request(client, "epd", request, sampling, 120)
            if sample.error:
                raise RuntimeError(f"profiling request failed: {sample.error}")
            windows.append((size, start, time.time_ns()))
            if not image:
                gaps += [b - a for a, b in itertools.pairwise(sample.piece_times)]
        batch_gaps: dict[int, list[float]] = {}
        for r in range(rounds):
            batch = [LoadRequest("text", f"Tell #{r}.{k}.", ()) for k in range(STEP_BATCH)]
            samples = await asyncio.gather(
                *(stream_request(client, "epd", b, sampling, 120) for b in batch)
            )
            if failed := [s.error for s in samples if s.error]:
                raise RuntimeError(f"profiling request failed: {failed[0]}")
            together, width = _gaps_together(samples)
            batch_gaps.setdefault(width, []).extend(together)
    widest = max(batch_gaps)
    return windows, gaps, (batch_gaps[widest], widest)


def measure_deployment(
    model: Path,
    machine: Machine,
    sweep: Sweep,
    timeout_s: float,
    command: str,
    prefill: PrefillProfile,
    decode: DecodeProfile,
) -> tuple[EncodeProfile, HopsProfile]:
    """The encode and hops profiles; the engine alone (``prefill``, ``decode``) tells what
    an image adds to prefill beyond its tokens and what serving each step through Triton
    adds."""
    from epd_bench.quick import embedded_deployment
    from orchestrator.families import family_for
    from orchestrator.tracing import read_spans
    from orchestrator.transfer.base import pool_bytes_for

    topology: Topology = default_topology(model, "E/P/D")
    family = family_for(model)
    requests: list[tuple[tuple[int, int], bytes | None]] = [((0, 0), None)] * 2  # warm-up
    serial = 0
    for size in sweep.sizes:
        for _ in range(sweep.images_per_size):
            requests.append((size, _photo(*size, serial)))
            serial += 1
    photos = requests[2:]
    requests += [((0, 0), None)] * sweep.images_per_size
    requests += photos  # again: the encoder's cache answers them
    cached = [i >= len(requests) - len(photos) for i in range(len(requests))]
    with embedded_deployment(topology, timeout_s, traces=True) as deployment:
        running = deployment.topology
        url = running.server_of("epd")[1].grpc_url
        encoder_pid = deployment.servers["encoder"].pid
        encoder_cpu = tree_cpu_s(encoder_pid)
        windows, gaps, batch_gaps = asyncio.run(_send_all(url, requests, sweep.repeats))
        encoder_cpu = tree_cpu_s(encoder_pid) - encoder_cpu
        time.sleep(1.0)  # the last spans are written when their servers end them
        spans = read_spans(running.tracing.directory)
    by_trace: dict[str, dict[str, float]] = {}
    roots: dict[str, int] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], {})[s["name"]] = (s["end_ns"] - s["start_ns"]) / 1e9
        if s["name"] == "epd" and s["parent_id"] is None:
            roots[s["trace_id"]] = s["start_ns"]
    encode_samples, encode_hop, llm_hop, kv, relay, pull = [], [], [], [], [], []
    text_prefill: list[float] = []
    image_prefill: list[tuple[tuple[int, int], float]] = []  # less the pull
    for (size, start, end), hit in zip(windows[2:], cached[2:], strict=True):
        trace = next((by_trace[t] for t, begun in roots.items() if start <= begun <= end), None)
        if trace is None:
            continue
        if "encode" in trace:
            encode_samples.append(
                EncodeSample(
                    width=size[0], height=size[1], images=1, latency_s=trace["encode"], cached=hit
                )
            )
            encode_hop.append(trace["call encode"] - trace["encode"])
            pull.append(trace.get("embedding_pull", 0.0))
            image_prefill.append((size, trace["prefill"] - trace.get("embedding_pull", 0.0)))
        else:
            text_prefill.append(trace["prefill"])
        llm_hop.append(trace["call prefill"] - trace["prefill"])
        kv.append(trace["call decode"] - trace["decode"] + trace.get("first_token", 0.0))
        relay.append(
            trace["epd"]
            - trace.get("call encode", 0.0)
            - trace["call prefill"]
            - trace["call decode"]
        )
    coefficients = _fit_encode([s for s in encode_samples if not s.cached], "encoded images")
    hit_coefficients = _fit_encode([s for s in encode_samples if s.cached], "cached images")
    largest = family.max_image_tokens()
    settings = getattr(family, "image_settings", None)
    unit = getattr(settings, "factor", None) or 28
    meta = {"model": model.name, "machine": machine, "measured_at": now(), "command": command}
    encode = EncodeProfile(
        **meta,
        base_s=0.0,
        image_s=coefficients[0],
        mpix_s=coefficients[1],
        hit_image_s=hit_coefficients[0],
        hit_mpix_s=hit_coefficients[1],
        instances=topology.servers["encoder"].instances.get("vision_encoder", 1),
        cache_entries=pool_bytes_for(topology.transfer.pool_bytes, family.max_image_bytes())
        // family.max_image_bytes(),
        token_unit_px=unit,
        max_image_tokens=largest,
        # over the time the calls spent at the encoder's server, its Triton's share included
        cores_busy=encoder_cpu / (sum(s.latency_s for s in encode_samples) + sum(encode_hop)),
        samples=encode_samples,
    )
    text = _median(text_prefill, "text-only prefill calls")
    together, batch = batch_gaps
    step, per_seq = serving_overheads(
        _median(gaps, "tokens"), _median(together, "tokens of requests at once"), batch, decode
    )
    image_input = [
        t - text - prefill.per_token_s * encode.image_tokens(*size) for size, t in image_prefill
    ]
    hops = HopsProfile(
        **meta,
        encode_call_s=_median(encode_hop, "encode calls"),
        llm_call_s=_median(llm_hop, "prefill calls"),
        kv_transfer_s=_median(kv, "decode calls"),
        token_relay_s=max(0.0, _median(relay, "epd requests")),
        embedding_pull_s=_median(pull, "embedding pulls"),
        request_input_s=max(0.0, text - prefill.base_s - prefill.per_request_s),
        image_input_s=max(0.0, _median(image_input, "prefill calls with an image")),
        step_overhead_s=step,
        step_overhead_per_seq_s=per_seq,
    )
    return encode, hops


async def _engine_samples(model: Path, sweep: Sweep):
    import random

    from vllm import SamplingParams

    from orchestrator.llm import LLMEngine, engine_args, engine_env
    from orchestrator.model.checkpoint import Checkpoint

    topology = default_topology(model, "E+PD")
    server, _ = topology.server_of("aggregated")
    args = engine_args(topology, server, "aggregated")
    env = engine_env(topology, server, "aggregated")
    engine = LLMEngine(args, env)
    # Plain text ids: above the low ids where small vocabularies keep their special tokens.
    vocab = int(Checkpoint.open(model).text_config["vocab_size"])
    low = min(vocab // 4, 1000)
    rng = random.Random(0)
    serial = 0

    async def one(tokens: int, max_tokens: int) -> list[float]:
        nonlocal serial
        serial += 1
        prompt = {"prompt_token_ids": [rng.randrange(low, vocab) for _ in range(tokens)]}
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        times = []
        async for _ in engine.generate(prompt, sampling):
            times.append(time.perf_counter())
        return times

    try:
        await one(16, 2)  # warm-up
        prefill, decode = [], []
        for tokens in sweep.prompt_tokens:
            for batch in sweep.prefill_batches:
                for _ in range(sweep.repeats):
                    start = time.perf_counter()
                    ends = await asyncio.gather(*(one(tokens, 1) for _ in range(batch)))
                    latency = max(t[0] for t in ends) - start
                    prefill.append(
                        PrefillSample(prompt_tokens=tokens, batch=batch, latency_s=latency)
                    )
        for context in sweep.decode_contexts:
            for batch in sweep.decode_batches:
                for _ in range(sweep.repeats):
                    runs = await asyncio.gather(
                        *(one(context, sweep.decode_tokens) for _ in range(batch))
                    )
                    # steps in which every sequence of the batch was decoding
                    first = max(t[1] for t in runs)
                    last = min(t[-1] for t in runs)
                    steps = min(sum(1 for x in t if first <= x <= last) for t in runs) - 1
                    if steps > 0:
                        decode.append(
                            DecodeSample(
                                batch=batch, context_tokens=context, itl_s=(last - first) / steps
                            )
                        )
        budget = int(args.get("max_num_batched_tokens") or max(8192, args["max_model_len"]))
        threads = int(env["OMP_NUM_THREADS"])
        return prefill, decode, int(args.get("max_num_seqs", 256)), budget, threads
    finally:
        engine.shutdown()


def measure_engine(
    model: Path, machine: Machine, sweep: Sweep, command: str
) -> tuple[PrefillProfile, DecodeProfile]:
    prefill, decode, max_seqs, budget, threads = asyncio.run(_engine_samples(model, sweep))
    meta = {
        "model": model.name,
        "machine": machine,
        "measured_at": now(),
        "command": command,
        "threads": threads,
    }
    p = fit(
        [[1.0, s.batch, s.prompt_tokens * s.batch] for s in prefill],
        [s.latency_s for s in prefill],
    )
    d = fit(
        [[1.0, s.batch, s.batch * s.context_tokens / 1000] for s in decode],
        [s.itl_s for s in decode],
    )
    return (
        PrefillProfile(
            **meta,
            base_s=p[0],
            per_request_s=p[1],
            per_token_s=p[2],
            budget_tokens=budget,
            max_seqs=max_seqs,
            samples=prefill,
        ),
        DecodeProfile(
            **meta, base_s=d[0], per_seq_s=d[1], per_kctx_s=d[2], max_seqs=max_seqs, samples=decode
        ),
    )
