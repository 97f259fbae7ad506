"""``epd plan ...``: capacity planning, registered on the product's ``epd`` CLI.

``epd plan profile`` measures this machine's stage profiles; ``epd plan`` reads profiles, a
workload and an SLO and recommends a fleet per layout (or, with ``--fleet``, predicts one
given fleet), printing the predicted percentiles, the bottleneck and the headroom, and
writing the topology of the recommendation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import yaml

DEFAULT_PROFILES = Path(".cache/plan/profiles")


def cmd_profile(args: argparse.Namespace) -> int:
    from epd_plan import measure, profile
    from orchestrator.cli import topology_of

    model = topology_of(argparse.Namespace(topology=None, model=args.model)).model
    machine = profile.Machine.this(args.machine, args.cost_per_hour)
    sweep = measure.Sweep.quick() if args.quick else measure.Sweep()
    command = "epd plan profile " + " ".join(sys.argv[3:])
    out = Path(args.out)
    print(f"profiling {model} on {machine.name} ({machine.cpu}, {machine.cores} cores)")
    prefill, decode = measure.measure_engine(model, machine, sweep, command)
    encode, hops = measure.measure_deployment(
        model, machine, sweep, args.timeout, command, prefill, decode
    )
    for p in (encode, hops, prefill, decode):
        print(f"wrote {profile.write(p, out)}")
    print(
        f"encode: {encode.image_s * 1e3:.2f} ms/image + {encode.mpix_s * 1e3:.2f} ms/MP "
        f"(cached: {encode.hit_image_s * 1e3:.2f} + {encode.hit_mpix_s * 1e3:.2f}); "
        f"prefill step: {prefill.base_s * 1e3:.2f} ms + {prefill.per_request_s * 1e3:.2f} "
        f"ms/request + {prefill.per_token_s * 1e6:.1f} us/token; "
        f"decode step: {decode.base_s * 1e3:.2f} ms + {decode.per_seq_s * 1e3:.3f} ms/seq; "
        f"hops: encode {hops.encode_call_s * 1e3:.1f}, llm {hops.llm_call_s * 1e3:.1f}, "
        f"kv {hops.kv_transfer_s * 1e3:.1f}, relay {hops.token_relay_s * 1e3:.1f}, pull "
        f"{hops.embedding_pull_s * 1e3:.1f}/image, request input "
        f"{hops.request_input_s * 1e3:.1f}, image input "
        f"{hops.image_input_s * 1e3:.1f}/image, step {hops.step_overhead_s * 1e3:.2f} ms + "
        f"{hops.step_overhead_per_seq_s * 1e3:.2f} ms/seq"
    )
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from epd_plan import validate
    from epd_plan.profile import Profiles
    from epd_plan.workload import PlanInputError
    from orchestrator.cli import topology_of

    try:
        profiles = Profiles.load(Path(args.profiles))
    except PlanInputError as exc:
        print(f"epd plan validate: {exc}", file=sys.stderr)
        return 2
    rates = {}
    for item in args.rate or ["image-heavy=6", "text-heavy=12", "repeated=10"]:
        scenario, _, rate = item.partition("=")
        if scenario not in validate.SCENARIOS:
            print(f"epd plan validate: unknown workload {scenario!r}; known: "
                  f"{', '.join(validate.SCENARIOS)}", file=sys.stderr)  # fmt: skip
            return 2
        try:
            rates[scenario] = float(rate)
        except ValueError:
            rates[scenario] = 0.0
        if not 0 < rates[scenario] < math.inf:
            print(f"epd plan validate: --rate {item!r}: give WORKLOAD=REQ_PER_S with a rate "
                  "above 0 (and finite), e.g. image-heavy=6", file=sys.stderr)  # fmt: skip
            return 2
    topology = topology_of(args)
    try:
        fleet = validate.fleet_of(topology, profiles)  # refused before anything starts
    except PlanInputError as exc:
        print(f"epd plan validate: {exc}", file=sys.stderr)
        return 2
    comparisons = validate.run(topology, fleet, profiles, rates, args.requests, args.timeout)
    print(validate.table(comparisons))
    command = "epd plan validate " + " ".join(sys.argv[3:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(validate.report(comparisons, command), indent=1, default=str) + "\n"
    )
    print(f"wrote {args.out}")
    return 0


def parse_fleet(text: str):
    """``LAYOUT stage=N[@machine] ...``, e.g. ``E/P/D encode=2 prefill=1 decode=3@h100``."""
    from epd_plan.simulate import LAYOUTS
    from epd_plan.workload import PlanInputError

    layout, *parts = text.split()
    if layout not in LAYOUTS:
        raise PlanInputError(f"--fleet: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    stages = {}
    for part in parts:
        stage, _, count = part.partition("=")
        replicas, _, machine = count.partition("@")
        if not replicas.isdigit():
            raise PlanInputError(f"--fleet: {part!r} is not stage=REPLICAS[@machine]")
        stages[stage] = (int(replicas), machine or None)
    return layout, stages


def _fleet(text: str, profiles, local_prefill_tokens: int = 0):
    from epd_plan.simulate import Fleet, StageCount

    layout, stages = parse_fleet(text)
    counts = {}
    for stage, (replicas, machine) in stages.items():
        if machine is None:
            source = "encode" if stage == "encode" else "prefill"
            machines = profiles.machines(source)
            machine = machines[0].name if machines else "?"
        counts[stage] = StageCount(machine, replicas)
    return Fleet(layout, counts, local_prefill_tokens)


def _row(label: str, p) -> str:
    util = ", ".join(f"{s} {u:.0%}" for s, u in p.utilization.items())
    return (
        f"{label:<44} TTFT p50/p90 {p.ttft_s.p50 * 1e3:8.1f}/{p.ttft_s.p90 * 1e3:8.1f} ms  "
        f"TPOT p90 {p.tpot_s.p90 * 1e3:7.2f} ms  {p.throughput_rps:9.1f} req/s  busy: {util}  "
        f"bottleneck {p.bottleneck}, headroom {1 - max(p.utilization.values()):.0%}"
        + ("" if p.local_prefill_share is None else f"  local prefill {p.local_prefill_share:.0%}")
        + ("" if p.stable else "  UNSTABLE")
    )


def _prediction_json(p) -> dict:
    data = asdict(p)
    data["fleet"] = {
        "layout": p.fleet.layout,
        "stages": {
            s: {"machine": c.machine, "replicas": c.replicas} for s, c in p.fleet.stages.items()
        },
        "local_prefill_tokens": p.fleet.local_prefill_tokens,
    }
    data["bottleneck"] = p.bottleneck
    return data


def cmd_scale(args: argparse.Namespace) -> int:
    from epd_plan import scale

    print(
        f"simulating {args.gpus} GPUs (synthetic profiles: not a measurement) at "
        f"{args.rate:g} req/s for {args.duration:g} s of arrivals"
    )
    run = scale.run(args.gpus, args.rate, args.duration)
    p = run.prediction
    fleet = ", ".join(f"{s}={c.replicas}" for s, c in p.fleet.stages.items())
    print(_row(f"E/P/D {fleet}", p))
    print(
        f"simulated {run.duration_s:g} s ({p.events:,} events) in {run.wall_s:.1f} s wall "
        f"({run.wall_s / p.events * 1e9:.0f} ns/event), compilation excluded"
    )
    if args.out:
        report = {
            "gpus": run.gpus,
            "rate_rps": run.rate_rps,
            "simulated_s": run.duration_s,
            "wall_s": run.wall_s,
            "prediction": _prediction_json(p),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0 if p.stable else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from epd_plan import planner
    from epd_plan.profile import Profiles
    from epd_plan.simulate import simulate
    from epd_plan.workload import PlanInputError, Slo, Workload, load, workload_of_trace

    try:
        profiles = Profiles.load(Path(args.profiles))
        if not args.workload:
            raise PlanInputError("--workload FILE is required (YAML: rate_rps, image_share, ...)")
        path = Path(args.workload)
        if path.suffix == ".jsonl":
            workload = workload_of_trace(path)
            print(f"workload from the trace {path}: {workload.model_dump_json()}")
        else:
            workload = load(path, Workload)
        if args.fleet:
            fleet = _fleet(args.fleet, profiles, args.max_local_prefill_tokens)
            p = simulate(fleet, profiles, workload)
            print(_row(fleet.describe(), p))
            print(f"simulated {p.events:,} events in {p.wall_s:.1f} s")
            report = {"prediction": _prediction_json(p)}
        else:
            if not args.slo:
                raise PlanInputError("--slo FILE is required (YAML: ttft_p90_s, tpot_p90_s)")
            slo = load(Path(args.slo), Slo)
            result = planner.plan(
                profiles,
                workload,
                slo,
                tuple(args.layout or planner.LAYOUTS),
                args.max_local_prefill_tokens,
            )
            report = _report_plan(result, profiles, args)
    except PlanInputError as exc:
        print(f"epd plan: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


def _report_plan(result, profiles, args: argparse.Namespace) -> dict:
    from epd_plan import planner

    report: dict = {"layouts": []}
    for lp in result.layouts:
        if lp.fleet is None:
            print(f"{lp.layout:<8} no fleet meets the SLO: {lp.why_not}")
            report["layouts"].append({"layout": lp.layout, "why_not": lp.why_not})
            continue
        print(_row(f"{lp.fleet.describe()} (cost {lp.cost:g}/h)", lp.prediction))
        report["layouts"].append(
            {"layout": lp.layout, "cost": lp.cost, "prediction": _prediction_json(lp.prediction)}
        )
    best = result.best
    if best is None:
        print("epd plan: no layout meets the SLO with the profiled hardware", file=sys.stderr)
        return report
    print(f"recommended: {best.fleet.describe()} at cost {best.cost:g}/h")
    report["recommended"] = best.layout
    if args.topology_out:
        topology = planner.topology_for(best.fleet, Path(args.model))
        data = json.loads(topology.model_dump_json(exclude_defaults=True))
        Path(args.topology_out).write_text(yaml.safe_dump(data, sort_keys=False))
        print(f"wrote {args.topology_out} (set each server's host to its address)")
    if best.layout == "E/P/D":
        replicas = planner.replica_counts(best.fleet)
        print(
            "deploy/k8s: replicas per Deployment (kustomization.yaml), and each stage's "
            "minReplicas (this workload at your base rate) or maxReplicas (at your peak) "
            "in hpa.yaml:"
        )
        print(yaml.safe_dump({"replicas": [{"name": n, "count": c} for n, c in replicas.items()]}))
        report["k8s_replicas"] = replicas
    return report


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``plan`` and ``plan profile`` to the ``epd`` parser's subcommands."""
    plan = sub.add_parser(
        "plan", help="capacity planning: fleet per stage for a workload and an SLO"
    )
    plan.add_argument("--profiles", default=str(DEFAULT_PROFILES), help="profile folder")
    plan.add_argument(
        "--workload",
        help="workload file (YAML/JSON), or a recorded trace (.jsonl, a request a line)",
    )
    plan.add_argument("--slo", help="SLO file (YAML/JSON): ttft_p90_s, tpot_p90_s")
    plan.add_argument("--layout", action="append", choices=["aggregated", "E+PD", "E/P/D"])
    plan.add_argument("--fleet", help="predict this fleet instead, e.g. 'E+PD encode=1 pd=2'")
    plan.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=0,
        help="E/P/D: prefill prompts of at most this many tokens (images included) in decode, "
        "skipping prefill, as routing.max_local_prefill_tokens does (default 0: never)",
    )
    plan.add_argument("--model", default="/models/model", help="model path in the topology")
    plan.add_argument("--topology-out", help="write the recommended fleet's topology here")
    plan.add_argument("--out", help="JSON report path")
    plan.set_defaults(func=cmd_plan)
    steps = plan.add_subparsers(dest="plan_command")
    prof = steps.add_parser("profile", help="measure this machine's stage profiles")
    from orchestrator.cli import DEFAULT_MODEL

    prof.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    prof.add_argument("--out", default=str(DEFAULT_PROFILES), help="profile folder")
    prof.add_argument("--machine", help="hardware name in the profiles (default cpu-<N>c)")
    prof.add_argument("--cost-per-hour", type=float, default=1.0)
    prof.add_argument("--quick", action="store_true", help="fewer samples (for tests)")
    prof.add_argument("--timeout", type=float, default=600, help="seconds to become ready")
    prof.set_defaults(func=cmd_profile)
    check = steps.add_parser(
        "validate", help="the simulator's predictions against real runs of the same workloads"
    )
    check.add_argument("--profiles", default=str(DEFAULT_PROFILES), help="profile folder")
    check.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (built if absent)")
    check.add_argument(
        "--topology",
        help="run this one-box topology (E+PD or E/P/D, one server per stage) instead of the "
        "embedded default",
    )
    check.add_argument(
        "--rate", action="append", help="WORKLOAD=REQ_PER_S (image-heavy, text-heavy, repeated)"
    )
    check.add_argument("--requests", type=int, default=200, help="requests per workload")
    check.add_argument("--timeout", type=float, default=600, help="seconds to become ready")
    check.add_argument("--out", default=".cache/plan/validate.json", help="JSON report path")
    check.set_defaults(func=cmd_validate)
    big = steps.add_parser("scale", help="time the simulator on a large fleet (synthetic profiles)")
    big.add_argument("--gpus", type=int, default=1000)
    big.add_argument("--rate", type=float, default=10000, help="requests per second")
    big.add_argument("--duration", type=float, default=3600, help="simulated seconds")
    big.add_argument("--out", help="JSON report path")
    big.set_defaults(func=cmd_scale)
