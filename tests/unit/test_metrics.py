"""The metric families a handler records, as a ``prometheus_client`` registry exposes
them when the handler runs outside Triton (the OpenAI front hosts ``epd``'s pipeline)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from orchestrator.metrics import RegistryPublisher


def test_registry_publisher_exposes_gauges_counters_and_histograms() -> None:
    registry = CollectorRegistry()
    metrics = RegistryPublisher(registry, {"server": "front"})
    state = {"outstanding": 3, "stopped": 2}
    metrics.gauge("epd_stage_outstanding", "calls", lambda: state["outstanding"], stage="pd")
    metrics.gauge("epd_stage_outstanding", "calls", lambda: 0, stage="encode")
    metrics.counter("epd_requests_stopped_total", "stopped", lambda: state["stopped"])
    hist = metrics.histogram("epd_request_phase_seconds", "phases", phase="encode")
    for seconds in (0.002, 0.02, 20.0):
        hist.observe(seconds)
    metrics.start()  # read at scrape time: nothing to run
    state["outstanding"] = 5

    lines = set(generate_latest(registry).decode().splitlines())
    assert 'epd_stage_outstanding{server="front",stage="pd"} 5.0' in lines
    assert 'epd_stage_outstanding{server="front",stage="encode"} 0.0' in lines
    assert "# TYPE epd_requests_stopped_total counter" in lines
    assert 'epd_requests_stopped_total{server="front"} 2.0' in lines
    bucket = 'epd_request_phase_seconds_bucket{le="%s",phase="encode",server="front"} %s'
    assert bucket % ("0.0025", "1.0") in lines
    assert bucket % ("0.025", "2.0") in lines
    assert bucket % ("+Inf", "3.0") in lines
    assert 'epd_request_phase_seconds_count{phase="encode",server="front"} 3.0' in lines

    asyncio.run(metrics.stop())  # unregistered: the registry no longer has them
    assert "epd_stage_outstanding" not in generate_latest(registry).decode()
