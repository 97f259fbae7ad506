"""``epd``: build the tiny model, render repositories, serve a topology, send a request,
benchmark ``epd`` against ``aggregated``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from orchestrator.model.build import Family, Profile

PROFILES = list(get_args(Profile))
FAMILIES = list(get_args(Family))

if TYPE_CHECKING:
    from orchestrator.triton.deployment import Deployment

DEFAULT_MODEL = Path(".cache/models/tiny")
DEFAULT_WORKDIR = Path(".cache/serve")
DEFAULT_BENCH_OUT = Path(".cache/bench/quick.json")


def _topology(args: argparse.Namespace):
    from orchestrator.config import Topology, default_topology

    if args.topology:
        try:
            return Topology.load(args.topology)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"epd: {exc}") from None
    model = Path(args.model)
    if model == DEFAULT_MODEL and not (model / "config.json").exists():
        from orchestrator.model.build import build_model

        print(f"building the tiny model into {model} ...", flush=True)
        build_model(model, profile="tiny")
    return default_topology(model.resolve())


def cmd_model_build(args: argparse.Namespace) -> int:
    from orchestrator.model.build import build_model

    try:
        path = build_model(
            Path(args.dir),
            profile=args.profile,
            seed=args.seed,
            family=args.family,
            hub_layout=args.hub_layout,
        )
    except ValueError as exc:
        print(f"epd model build: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from orchestrator.triton.repository import render

    try:
        repos = render(_topology(args), Path(args.out), progress=True)
    except ValueError as exc:  # the checkpoint (CheckpointError) or the pool size
        print(f"epd render: {exc}", file=sys.stderr)
        return 2
    for server, repo in repos.items():
        print(f"{server}: {repo}")
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.triton.deployment import Deployment, DeploymentBusy

    topology = _topology(args)
    try:
        deployment = Deployment(
            topology, Path(args.workdir), only=args.server, progress=lambda s: print(s, flush=True)
        )
    except ValueError as exc:  # nothing started: a bad checkpoint, family, pool or server
        print(f"epd serve: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM stop everything in order. SIGINT is set explicitly: a shell that
    # starts us in the background without job control leaves it ignored otherwise.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    print(f"model: {topology.model} ({deployment.family.model_type})", flush=True)
    print("starting servers:", ", ".join(deployment.local), flush=True)
    try:
        with deployment.running(timeout_s=args.timeout):
            for name, spec in deployment.local.items():
                print(f"  {name:8s} http://{spec.http_url} grpc {spec.grpc_url}: {spec.stages}")
            print(f"logs: {deployment.workdir / 'logs'}", flush=True)
            for front in deployment.openai.values():
                print(_openai_example(f"{front.url}/v1", topology.served_model_name), flush=True)
            if args.demo:
                _demo(deployment)
            print("serving; Ctrl-C to stop", flush=True)
            threading.Event().wait()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    except DeploymentBusy as exc:
        print(f"epd serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _openai_example(base_url: str, model: str) -> str:
    return f"""OpenAI API: {base_url}  (model "{model}"; "epd" and "aggregated" name each path)
  curl {base_url}/chat/completions -H 'Content-Type: application/json' -d '{{
    "model": "{model}", "max_tokens": 32, "messages": [{{"role": "user", "content": [
      {{"type": "image_url", "image_url": {{
        "url": "data:image/jpeg;base64,'"$(base64 -w0 photo.jpg)"'"}}}},
      {{"type": "text", "text": "Describe this image."}}]}}]}}'
  python -c 'import openai; print(openai.OpenAI(base_url="{base_url}", api_key="-")
    .chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hi"}}]))'"""


def _demo(deployment: Deployment) -> None:
    """Send the README's request (a real photo) to ``epd`` and ``aggregated``, and to the
    OpenAI API; print the answers."""
    import base64

    from orchestrator.client import generate, sample_photo

    photo = sample_photo()
    for model in ("epd", "aggregated"):
        hosts = [s for s in deployment.local.values() if model in s.stages]
        for server in hosts:
            text = generate(server.http_url, model, "Describe this image.", [photo], 16)
            print(f"{model} answered: {text!r}", flush=True)
    for front in deployment.openai.values():
        import openai

        url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe this image."},
        ]
        answer = openai.OpenAI(base_url=f"{front.url}/v1", api_key="-").chat.completions.create(
            model=deployment.topology.served_model_name,
            messages=[{"role": "user", "content": content}],
            max_tokens=16,
            temperature=0,
        )
        print(f"OpenAI API answered: {answer.choices[0].message.content!r}", flush=True)


def cmd_encoder_export(args: argparse.Namespace) -> int:
    from orchestrator.encoder.onnx_export import export_vision_encoder

    try:
        out = export_vision_encoder(
            Path(args.model_dir), Path(args.out), target=args.target, progress=True
        )
    except ValueError as exc:
        print(f"epd encoder export: {exc}", file=sys.stderr)
        return 2
    from orchestrator.encoder.onnx_export import describe

    print(f"vision encoder: {describe(out)}", file=sys.stderr)
    print(out)
    return 0


def cmd_encoder_build(args: argparse.Namespace) -> int:
    import json

    from orchestrator.encoder.build import build_tensorrt_plan
    from orchestrator.encoder.runtime import TensorRTUnavailable

    try:
        report = build_tensorrt_plan(Path(args.model_dir), args.plan, fp16=args.fp16)
    except TensorRTUnavailable as exc:
        print(f"epd encoder build: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    from orchestrator.client import generate

    images = [Path(p).read_bytes() for p in args.image]
    print(generate(args.url, args.model, args.text, images, args.max_tokens))
    return 0


def cmd_bench_cache(args: argparse.Namespace) -> int:
    import contextlib

    from orchestrator.bench import cache, quick

    signal.signal(signal.SIGTERM, _interrupt)  # unwind through the deployment's finally
    if args.url and not args.topology:
        print("epd bench cache: --url needs --topology (to count encoder passes)", file=sys.stderr)
        return 2
    try:
        settings = quick.Settings(
            requests=args.images,
            concurrency=args.concurrency,
            rounds=args.rounds,
            max_tokens=args.max_tokens,
            timeout_s=args.request_timeout,
        )
        topology = _topology(args)
        with contextlib.ExitStack() as stack:
            url = args.url
            if url is None:
                print("starting the embedded deployment on free ports ...", flush=True)
                topology = stack.enter_context(quick.embedded(topology, args.timeout))
                url = topology.server_of("epd")[1].grpc_url
            cli_args = {k: v for k, v in vars(args).items() if k != "func"}
            report = cache.run(url, topology, settings, args.images, cli_args)
    except quick.BenchError as exc:
        print(f"epd bench cache: {exc}", file=sys.stderr)
        return 2
    print(cache.ratio_line(report))
    for error in report["errors"]:
        print(f"error: {error}", file=sys.stderr)
    quick.write_report(report, Path(args.out))
    print(f"wrote {args.out}")
    return 0


def _load_plan(args: argparse.Namespace, models: tuple[str, ...]):
    from orchestrator.bench.load import WORKLOADS, LoadPlan

    workloads = tuple(args.workload)
    if unknown := set(workloads) - set(WORKLOADS):
        raise SystemExit(f"epd: unknown workload(s) {sorted(unknown)}; known: {sorted(WORKLOADS)}")
    concurrency = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else ()
    rates = tuple(float(r) for r in args.rate.split(",")) if args.rate else ()
    if not concurrency and not rates:
        raise SystemExit("epd: give --concurrency and/or --rate levels")
    if any(c < 1 for c in concurrency) or any(r <= 0 for r in rates) or args.requests < 1:
        raise SystemExit("epd: levels and --requests must be positive")
    return LoadPlan(
        models=models,
        workloads=workloads,
        concurrency=concurrency,
        rates=rates,
        requests=args.requests,
        max_tokens=args.max_tokens,
        timeout_s=args.request_timeout,
    )


def _write_bench(results, args: argparse.Namespace, notes: list[str]) -> None:
    from orchestrator.bench.load import report

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(" ".join(sys.argv), results, notes).model_dump_json(indent=1) + "\n")
    print(f"wrote {out}")


def cmd_bench_run(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from orchestrator.bench import load, quick

    signal.signal(signal.SIGTERM, _interrupt)
    plan = _load_plan(args, tuple(args.models.split(",")))
    with contextlib.ExitStack() as stack:
        url, metrics = args.url, None
        if url is None:
            print("starting the embedded deployment on free ports ...", flush=True)
            running = stack.enter_context(quick.embedded(_topology(args), args.timeout))
            front = running.server_of("epd")[1]
            url, metrics = front.grpc_url, (front.host, front.metrics_port)
        results = asyncio.run(load.execute(url, plan, front_metrics=metrics))
    _write_bench(results, args, [])
    return 0


def cmd_bench_ab(args: argparse.Namespace) -> int:
    from orchestrator.bench import ab

    signal.signal(signal.SIGTERM, _interrupt)
    if unknown := set(args.variant) - set(ab.NAMES):
        raise SystemExit(f"epd: unknown variant(s) {sorted(unknown)}; known: {list(ab.NAMES)}")
    plan = _load_plan(args, ())
    model = Path(args.model)
    if not (model / "config.json").exists():
        from orchestrator.model.build import build_model

        print(f"building the {args.profile} model into {model} ...", flush=True)
        build_model(model, profile=args.profile)
    cpus = args.pin_cpus.split(":") if args.pin_cpus else None
    threads = args.encoder_threads
    results = ab.run(model.resolve(), args.variant, plan, args.timeout, cpus, threads)
    notes = [f"cpu pinning per server (round-robin): {cpus}"] if cpus else []
    notes += [f"encoder ONNX Runtime threads: {threads}"] if threads else []
    _write_bench(results, args, notes)
    return 0


def _add_load_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument("--workload", action="append", help="image|text|mixed|repeated|multi|large")
    parser.add_argument("--concurrency", default="1,4", help="closed-loop levels, e.g. 1,2,4,8")
    parser.add_argument("--rate", help="open-loop levels in requests/s, e.g. 1,2")
    parser.add_argument("--requests", type=int, default=24, help="requests per load point")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=300, help="seconds per request")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to become ready")
    parser.add_argument("--out", default=out, help="JSON report path")


def cmd_bench_encoder(args: argparse.Namespace) -> int:
    import json

    from orchestrator.bench import encoder

    sides = [int(s) for s in args.sizes.split(",")]
    report = encoder.run(Path(args.workdir), sides, args.threads, args.repeats)
    report["command"] = " ".join(sys.argv)
    print(encoder.summary(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def cmd_bench_openai(args: argparse.Namespace) -> int:
    from orchestrator.bench import openai_peer

    workdir = Path(args.workdir) if args.workdir else openai_peer.default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    results = openai_peer.run(
        _topology(args), args.prompts, args.warmups, args.concurrency, args.repeats, workdir
    )
    print(openai_peer.format_report(results))
    openai_peer.write(results, Path(args.out), " ".join(sys.argv))
    print(f"wrote {args.out}")
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from orchestrator.bench import soak

    report = soak.run(_topology(args), args.requests, args.warmup, args.concurrency)
    print(soak.format_report(report))
    soak.write(report, Path(args.out), " ".join(sys.argv))
    print(f"wrote {args.out}")
    return 0 if not report.errors else 1


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from orchestrator.bench import transfer

    signal.signal(signal.SIGTERM, _interrupt)  # unwind through the peers' finally
    return transfer.run_cli(args)


def cmd_bench_report(args: argparse.Namespace) -> int:
    import json

    from orchestrator.bench import report

    reports = report.load_reports([Path(p) for p in args.runs])
    cache = json.loads(Path(args.cache).read_text()) if args.cache else None
    transfer = json.loads(Path(args.transfer).read_text()) if args.transfer else None
    analysis = Path(args.analysis).read_text() if args.analysis else ""
    text = report.render(reports, Path(args.out), Path(args.img), cache, transfer, analysis)
    print(text.split("## Runs")[0].rstrip())
    print(f"wrote {args.out} and plots under {args.img}")
    return 0


def cmd_bench_quick(args: argparse.Namespace) -> int:
    import contextlib

    from orchestrator.bench import quick

    signal.signal(signal.SIGTERM, _interrupt)  # unwind through the deployment's finally
    try:
        settings = quick.Settings(
            requests=args.requests,
            concurrency=args.concurrency,
            rounds=args.rounds,
            max_tokens=args.max_tokens,
            timeout_s=args.request_timeout,
        )
        with contextlib.ExitStack() as stack:
            url = args.url
            if url is None:
                topology = _topology(args)
                print("starting the embedded deployment on free ports ...", flush=True)
                running = stack.enter_context(quick.embedded(topology, args.timeout))
                url = running.server_of("epd")[1].grpc_url
            cli_args = {k: v for k, v in vars(args).items() if k != "func"}
            report = quick.run(url, settings, cli_args)
    except quick.BenchError as exc:
        print(f"epd bench quick: {exc}", file=sys.stderr)
        return 2
    print(quick.format_table(report["models"]))
    print(quick.ratio_line(report["ratios"]))
    for line in quick.warnings(report):
        print(line, file=sys.stderr)
    quick.write_report(report, Path(args.out))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def topo_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--topology", help="topology YAML (default: the embedded CPU layout)")
        p.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")

    model = sub.add_parser("model", help="model utilities").add_subparsers(
        dest="sub", required=True
    )
    build = model.add_parser("build", help="build a random-weight checkpoint offline")
    build.add_argument("dir")
    build.add_argument("--family", choices=FAMILIES, default="qwen2_vl")
    build.add_argument("--profile", choices=PROFILES, default="tiny", help="qwen2_vl only")
    build.add_argument(
        "--hub-layout", action="store_true", help="bf16 in several shards, as a download"
    )
    build.add_argument("--seed", type=int, default=0)
    build.set_defaults(func=cmd_model_build)

    encoder = sub.add_parser("encoder", help="vision encoder artifacts").add_subparsers(
        dest="sub", required=True
    )
    export = encoder.add_parser("export", help="export the vision tower to ONNX")
    export.add_argument("model_dir")
    export.add_argument("out")
    export.add_argument(
        "--target", choices=["onnxruntime", "tensorrt"], default="onnxruntime", help="runtime"
    )
    export.set_defaults(func=cmd_encoder_export)
    trt = encoder.add_parser("build", help="build a TensorRT plan (GPU hosts) and check it")
    trt.add_argument("model_dir")
    trt.add_argument("--trt", action="store_true", required=True)
    trt.add_argument("--plan", type=Path, help="default: MODEL_DIR/vision_encoder.plan")
    trt.add_argument("--fp16", action="store_true")
    trt.set_defaults(func=cmd_encoder_build)

    render = sub.add_parser("render", help="write each server's Triton model repository")
    topo_args(render)
    render.add_argument("out")
    render.set_defaults(func=cmd_render)

    serve = sub.add_parser("serve", help="start every server of the topology and wait")
    topo_args(serve)
    serve.add_argument("--workdir", default=str(DEFAULT_WORKDIR))
    serve.add_argument("--timeout", type=float, default=300, help="seconds to become ready")
    serve.add_argument(
        "--server",
        action="append",
        help="start only this server of the topology (repeatable; one host of many)",
    )
    serve.add_argument("--demo", action="store_true", help="send a real photo once ready")
    serve.set_defaults(func=cmd_serve)

    infer = sub.add_parser("infer", help="send one request over HTTP and print the text")
    infer.add_argument("--url", default="127.0.0.1:8000")
    infer.add_argument("--model", default="epd")
    infer.add_argument("--text", required=True)
    infer.add_argument("--image", action="append", default=[])
    infer.add_argument("--max-tokens", type=int, default=32)
    infer.set_defaults(func=cmd_infer)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="sub", required=True)
    run = bench.add_parser("run", help="load generator: workloads x models x load levels")
    run.add_argument("--url", help="gRPC HOST:PORT of a running front (default: start one)")
    run.add_argument("--topology", help="topology file for the embedded deployment")
    run.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    run.add_argument("--models", default="epd,aggregated", help="comma-separated")
    _add_load_arguments(run, ".cache/bench/run.json")
    run.set_defaults(func=cmd_bench_run)
    ab = bench.add_parser("ab", help="the same workload against several deployments")
    ab.add_argument("--variant", action="append", help="deployment variants (default: all)")
    ab.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    ab.add_argument("--profile", choices=PROFILES, default="tiny", help="if built")
    ab.add_argument("--pin-cpus", help="CPU lists per server, round-robin, e.g. 0:1")
    ab.add_argument("--encoder-threads", type=int, help="ONNX Runtime threads of the encoder")
    _add_load_arguments(ab, ".cache/bench/ab.json")
    ab.set_defaults(func=cmd_bench_ab)
    from orchestrator.bench import perf_analyzer as pa_bench
    from orchestrator.bench import transfer as transfer_bench

    pa_bench.add_arguments(
        bench.add_parser("perf-analyzer", help="Triton's perf_analyzer against epd or aggregated")
    )

    xfer = bench.add_parser("transfer", help="embedding fetch per transport vs same-host memcpy")
    transfer_bench.add_arguments(xfer)
    xfer.set_defaults(func=cmd_bench_transfer)
    enc = bench.add_parser(
        "encoder", help="a real-size tower (Qwen2.5-VL-7B vision): export, ORT vs torch per image"
    )
    enc.add_argument("--sizes", default="448,1344", help="square image sides in pixels")
    enc.add_argument("--threads", type=int, default=2, help="threads for both runtimes")
    enc.add_argument("--repeats", type=int, default=2, help="timed passes per size")
    enc.add_argument("--workdir", default=".cache/bench/encoder", help="checkpoint + export")
    enc.add_argument("--out", default=".cache/bench/encoder.json", help="JSON report path")
    enc.set_defaults(func=cmd_bench_encoder)
    rep = bench.add_parser("report", help="Markdown + plots from benchmark JSON files")
    rep.add_argument("runs", nargs="+", help="JSON from `bench run` / `ab` / `perf-analyzer`")
    rep.add_argument("--cache", help="JSON from `epd bench cache`")
    rep.add_argument("--transfer", help="JSON from `epd bench transfer`")
    rep.add_argument("--analysis", help="Markdown with a person's reading of the numbers")
    rep.add_argument("--out", default="docs/benchmarks.md")
    rep.add_argument("--img", default="docs/img")
    rep.set_defaults(func=cmd_bench_report)
    cache = bench.add_parser("cache", help="TTFT of repeated images (cache hits) vs new ones")
    cache.add_argument("--url", help="gRPC HOST:PORT of a running front (needs --topology)")
    cache.add_argument("--topology", help="the running deployment's topology (its encoders)")
    cache.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    cache.add_argument("--timeout", type=float, default=600, help="seconds to become ready")
    cache.add_argument("--images", type=int, default=8, help="new photos per round")
    cache.add_argument("--concurrency", type=int, default=2, help="streams in flight")
    cache.add_argument("--rounds", type=int, default=3)
    cache.add_argument("--max-tokens", type=int, default=8)
    cache.add_argument("--request-timeout", type=float, default=300, help="seconds per request")
    cache.add_argument("--out", default=".cache/bench/cache.json", help="JSON report path")
    cache.set_defaults(func=cmd_bench_cache)

    soak = bench.add_parser("soak", help="many mixed requests: errors and memory growth")
    soak.add_argument("--topology", help="topology to run (default: the embedded one)")
    soak.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    soak.add_argument("--requests", type=int, default=10_000, help="measured requests")
    soak.add_argument("--warmup", type=int, default=300, help="requests before the baseline")
    soak.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    soak.add_argument("--out", default=".cache/bench/soak.json", help="JSON report path")
    soak.set_defaults(func=cmd_bench_soak)

    peer = bench.add_parser(
        "openai", help="our OpenAI endpoint vs plain vllm serve (vllm bench serve, per kind)"
    )
    peer.add_argument("--topology", help="topology to run (default: the embedded one)")
    peer.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    peer.add_argument("--prompts", type=int, default=80, help="measured requests per run")
    peer.add_argument("--warmups", type=int, default=12, help="requests before each run")
    peer.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    peer.add_argument("--repeats", type=int, default=3, help="runs per peer and kind")
    peer.add_argument("--workdir", help="where servers log and runs write (default: a temp dir)")
    peer.add_argument("--out", default=".cache/bench/openai.json", help="JSON report path")
    peer.set_defaults(func=cmd_bench_openai)

    quick = bench.add_parser("quick", help="TTFT and throughput of epd vs aggregated")
    quick.add_argument("--url", help="gRPC HOST:PORT of a running front (default: start one)")
    quick.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    quick.add_argument("--timeout", type=float, default=600, help="seconds to become ready")
    quick.add_argument("--requests", type=int, default=24, help="requests per model per round")
    quick.add_argument("--concurrency", type=int, default=4, help="streams in flight")
    quick.add_argument("--rounds", type=int, default=2, help="alternating epd/aggregated rounds")
    quick.add_argument("--max-tokens", type=int, default=16)
    quick.add_argument("--request-timeout", type=float, default=300, help="seconds per request")
    quick.add_argument("--out", default=str(DEFAULT_BENCH_OUT), help="JSON report path")
    quick.set_defaults(func=cmd_bench_quick, topology=None)

    args = parser.parse_args(argv)
    if getattr(args, "func", None) in (cmd_bench_run, cmd_bench_ab):
        args.workload = args.workload or ["mixed"]
    if getattr(args, "func", None) is cmd_bench_ab:
        from orchestrator.bench.ab import NAMES

        args.variant = args.variant or list(NAMES)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
