"""``epd``: build the tiny model, render repositories, serve a topology, send a request,
benchmark ``epd`` against ``aggregated``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from orchestrator.model.build import Family, Profile

PROFILES = list(get_args(Profile))
FAMILIES = list(get_args(Family))

if TYPE_CHECKING:
    from orchestrator.triton.deployment import Deployment

DEFAULT_MODEL = Path(".cache/models/tiny")
DEFAULT_WORKDIR = Path(".cache/serve")
COMMANDS_GROUP = "epd.commands"
"""Entry points ``f(subparsers)`` that add subcommands to ``epd`` (``bench``: epd_bench)."""


def topology_of(args: argparse.Namespace, baseline: bool = True):
    """``--topology``'s file, or the embedded layout on ``--model`` (its front hosting
    ``aggregated`` too with ``baseline``)."""
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
    return default_topology(model.resolve(), baseline=baseline)


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
        repos = render(topology_of(args, baseline_of(args)), Path(args.out), progress=True)
    except ValueError as exc:  # the checkpoint (CheckpointError) or the pool size
        print(f"epd render: {exc}", file=sys.stderr)
        return 2
    for server, repo in repos.items():
        print(f"{server}: {repo}")
    return 0


def interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.triton.deployment import Deployment, DeploymentBusy

    topology = topology_of(args, baseline_of(args))
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
        signal.signal(sig, interrupt)
    print(f"model: {topology.model} ({deployment.family.model_type})", flush=True)
    print("starting servers:", ", ".join(deployment.local), flush=True)
    try:
        with deployment.running(timeout_s=args.timeout):
            for name, spec in deployment.local.items():
                print(f"  {name:8s} http://{spec.http_url} grpc {spec.grpc_url}: {spec.stages}")
            print(f"logs: {deployment.workdir / 'logs'}", flush=True)
            for front in deployment.openai.values():
                paths = [m for m in ("epd", "aggregated") if topology.servers_of(m)]
                print(
                    _openai_example(f"{front.url}/v1", topology.served_model_name, paths),
                    flush=True,
                )
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


def baseline_of(args: argparse.Namespace) -> bool:
    """Whether the embedded layout's front hosts ``aggregated`` (``--baseline``): off unless
    asked, since it holds a second copy of the model (on one GPU, where the first engine
    takes most of the memory, it would not even start)."""
    if args.baseline and args.topology:
        raise SystemExit(
            "epd: --baseline adds `aggregated` to the embedded layout; a topology file "
            "names its front's models itself"
        )
    return bool(args.baseline)


def _openai_example(base_url: str, model: str, paths: list[str]) -> str:
    named = ", ".join(f'"{p}"' for p in paths)
    return f"""OpenAI API: {base_url}  (model "{model}", or a path by name: {named})
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def topo_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--topology", help="topology YAML (default: the embedded CPU layout)")
        p.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
        p.add_argument(
            "--baseline",
            action="store_true",
            help="the embedded layout's front also hosts `aggregated` (one engine, pixels in) "
            "to compare against: a second copy of the model",
        )

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

    # Commands that live beside the product (``epd bench``) register through an entry point
    # group, as vLLM's plugins do: the product imports none of them.
    for entry in metadata.entry_points(group=COMMANDS_GROUP):
        entry.load()(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
