"""``epd``: build the tiny model, render repositories, serve a topology, send a request."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

DEFAULT_MODEL = Path(".cache/models/tiny")
DEFAULT_WORKDIR = Path(".cache/serve")


def _topology(args: argparse.Namespace):
    from orchestrator.config import Topology, default_topology

    if args.topology:
        return Topology.load(args.topology)
    model = Path(args.model)
    if not (model / "config.json").exists():
        from orchestrator.model.tiny import build_model

        print(f"building the tiny model into {model} ...", flush=True)
        build_model(model, profile="tiny")
    return default_topology(model.resolve())


def cmd_model_build(args: argparse.Namespace) -> int:
    from orchestrator.model.tiny import build_model

    path = build_model(Path(args.dir), profile=args.profile, seed=args.seed)
    print(path)
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from orchestrator.triton.repository import render

    for server, repo in render(_topology(args), Path(args.out)).items():
        print(f"{server}: {repo}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.triton.deployment import Deployment, DeploymentBusy

    topology = _topology(args)
    deployment = Deployment(topology, Path(args.workdir))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("starting servers:", ", ".join(topology.servers), flush=True)
    try:
        with deployment.running(timeout_s=args.timeout):
            for name, spec in topology.servers.items():
                print(f"  {name:8s} http://{spec.http_url} grpc {spec.grpc_url}: {spec.stages}")
            print(f"logs: {deployment.workdir / 'logs'}", flush=True)
            if args.demo:
                _demo(topology)
            if args.exit_after_demo:
                return 0
            print("serving; Ctrl-C to stop", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
            print("stopping ...", flush=True)
    except DeploymentBusy as exc:
        print(f"epd serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo(topology) -> None:
    """Send the README's request (a real photo) to ``epd`` and ``aggregated``; print both."""
    from orchestrator.client import generate, sample_photo

    _, front = topology.server_of("epd")
    for model in ("epd", "aggregated"):
        text = generate(front.http_url, model, "Describe this image.", [sample_photo()], 16)
        print(f"{model} answered: {text!r}", flush=True)


def cmd_infer(args: argparse.Namespace) -> int:
    from orchestrator.client import generate

    images = [Path(p).read_bytes() for p in args.image]
    print(generate(args.url, args.model, args.text, images, args.max_tokens))
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
    build = model.add_parser("build", help="build a random-weight Qwen2-VL offline")
    build.add_argument("dir")
    build.add_argument("--profile", choices=["tiny", "bench"], default="tiny")
    build.add_argument("--seed", type=int, default=0)
    build.set_defaults(func=cmd_model_build)

    render = sub.add_parser("render", help="write each server's Triton model repository")
    topo_args(render)
    render.add_argument("out")
    render.set_defaults(func=cmd_render)

    serve = sub.add_parser("serve", help="start every server of the topology and wait")
    topo_args(serve)
    serve.add_argument("--workdir", default=str(DEFAULT_WORKDIR))
    serve.add_argument("--timeout", type=float, default=300, help="seconds to become ready")
    serve.add_argument("--demo", action="store_true", help="send a real photo once ready")
    serve.add_argument("--exit-after-demo", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)

    infer = sub.add_parser("infer", help="send one request over HTTP and print the text")
    infer.add_argument("--url", default="127.0.0.1:8000")
    infer.add_argument("--model", default="epd")
    infer.add_argument("--text", required=True)
    infer.add_argument("--image", action="append", default=[])
    infer.add_argument("--max-tokens", type=int, default=32)
    infer.set_defaults(func=cmd_infer)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
