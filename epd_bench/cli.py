"""``epd bench ...``: the benchmark commands, registered on the product's ``epd`` CLI."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from orchestrator.cli import DEFAULT_MODEL, PROFILES, baseline_of, interrupt, topology_of

DEFAULT_BENCH_OUT = Path(".cache/bench/quick.json")


def cmd_bench_cache(args: argparse.Namespace) -> int:
    import contextlib

    from epd_bench import cache, quick

    signal.signal(signal.SIGTERM, interrupt)  # unwind through the deployment's finally
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
        topology = topology_of(args)
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
    from epd_bench.load import WORKLOADS, LoadPlan

    workloads = tuple(args.workload or ["mixed"])
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
    from epd_bench.load import report

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(" ".join(sys.argv), results, notes).model_dump_json(indent=1) + "\n")
    print(f"wrote {out}")


def cmd_bench_run(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from epd_bench import load, quick

    signal.signal(signal.SIGTERM, interrupt)
    plan = _load_plan(args, tuple(args.models.split(",")))
    with contextlib.ExitStack() as stack:
        url, metrics = args.url, None
        if url is None:
            print("starting the embedded deployment on free ports ...", flush=True)
            embedded = quick.embedded(topology_of(args), args.timeout, args.traces)
            running = stack.enter_context(embedded)
            front = running.server_of("epd")[1]
            url, metrics = front.grpc_url, (front.host, front.metrics_port)
            traces = running.tracing.directory
        elif args.traces:
            raise SystemExit("epd: --traces needs the embedded deployment (no --url)")
        else:
            traces = None
        results = asyncio.run(load.execute(url, plan, front_metrics=metrics, traces=traces))
    _write_bench(results, args, [])
    return 0


def cmd_bench_ab(args: argparse.Namespace) -> int:
    from epd_bench import ab

    signal.signal(signal.SIGTERM, interrupt)
    args.variant = args.variant or list(ab.NAMES)
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
    results = ab.run(model.resolve(), args.variant, plan, args.timeout, cpus, threads, args.traces)
    notes = [f"cpu pinning per server (round-robin): {cpus}"] if cpus else []
    notes += [f"encoder ONNX Runtime threads: {threads}"] if threads else []
    _write_bench(results, args, notes)
    return 0


def _add_load_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument(
        "--traces",
        action="store_true",
        help="trace every request (OpenTelemetry) and print the time of each hop",
    )
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

    from epd_bench import encoder

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
    from epd_bench import openai_peer

    workdir = Path(args.workdir) if args.workdir else openai_peer.default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    kinds = tuple(args.kinds.split(","))
    if unknown := set(kinds) - set(openai_peer.ALL_KINDS):
        print(f"epd bench openai: unknown --kinds {sorted(unknown)}", file=sys.stderr)
        return 2
    results = openai_peer.run(
        topology_of(args), args.prompts, args.warmups, args.concurrency, args.repeats, workdir,
        kinds,
    )  # fmt: skip
    print(openai_peer.format_report(results))
    openai_peer.write(results, Path(args.out), " ".join(sys.argv))
    print(f"wrote {args.out}")
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from epd_bench import soak

    report = soak.run(topology_of(args), args.requests, args.warmup, args.concurrency)
    print(soak.format_report(report))
    soak.write(report, Path(args.out), " ".join(sys.argv))
    print(f"wrote {args.out}")
    return 0 if not report.errors else 1


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from epd_bench import transfer

    signal.signal(signal.SIGTERM, interrupt)  # unwind through the peers' finally
    return transfer.run_cli(args)


def cmd_bench_report(args: argparse.Namespace) -> int:
    import json

    from epd_bench import report

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

    from epd_bench import quick

    signal.signal(signal.SIGTERM, interrupt)  # unwind through the deployment's finally
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
                topology = topology_of(args)
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


def cmd_bench_idle(args: argparse.Namespace) -> int:
    from epd_bench import idle
    from epd_bench.quick import write_report

    signal.signal(signal.SIGTERM, interrupt)
    topology = topology_of(args, baseline_of(args))
    report = idle.run(topology, args.settle, args.window, args.timeout)
    print(idle.format_report(report))
    write_report(report, Path(args.out))
    print(f"report: {args.out}")
    return 0


def _deployment_arguments(parser: argparse.ArgumentParser) -> None:
    """The deployment a command starts: a topology file, or the embedded one on a model."""
    parser.add_argument("--topology", help="topology to run (default: the embedded one)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the ``epd`` parser's subcommands."""
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
    from epd_bench import perf_analyzer as pa_bench
    from epd_bench import transfer as transfer_bench

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
    _deployment_arguments(soak)
    soak.add_argument("--requests", type=int, default=10_000, help="measured requests")
    soak.add_argument("--warmup", type=int, default=300, help="requests before the baseline")
    soak.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    soak.add_argument("--out", default=".cache/bench/soak.json", help="JSON report path")
    soak.set_defaults(func=cmd_bench_soak)

    idle = bench.add_parser(
        "idle", help="CPU the deployment burns with no traffic (what `epd serve` starts)"
    )
    _deployment_arguments(idle)
    idle.add_argument("--settle", type=float, default=10, help="seconds before measuring")
    idle.add_argument("--window", type=float, default=30, help="seconds measured")
    idle.add_argument("--timeout", type=float, default=600, help="seconds to become ready")
    idle.add_argument("--out", default=".cache/bench/idle.json", help="JSON report path")
    idle.add_argument(
        "--baseline",
        action="store_true",
        help="as `epd serve --baseline`: the front also hosts `aggregated` (a second engine)",
    )
    idle.set_defaults(func=cmd_bench_idle)

    peer = bench.add_parser(
        "openai", help="our OpenAI endpoint vs plain vllm serve (vllm bench serve, per kind)"
    )
    _deployment_arguments(peer)
    peer.add_argument("--prompts", type=int, default=80, help="measured requests per run")
    peer.add_argument("--warmups", type=int, default=12, help="requests before each run")
    peer.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    peer.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds: each one run per peer and kind, order swapped",
    )
    peer.add_argument(
        "--kinds",
        default="photo,text,mixed",
        help="workloads, comma-separated: photo, text, mixed (text measured beside photos), "
        "completions (text prompts through /v1/completions)",
    )
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
