"""Capacity planning, beside the product (``orchestrator``), not in it: measured per-stage
profiles, a compiled discrete-event simulation of a fleet, and the search for the cheapest
fleet per layout that meets a TTFT/TPOT target. ``epd plan ...`` registers its commands
(``epd_plan.cli``); it drives the product only through its public interfaces (topology,
deployment, Triton endpoints, traces)."""
