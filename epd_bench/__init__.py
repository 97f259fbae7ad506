"""Benchmarks of the serving stack, beside the product (``orchestrator``), not in it: they
measure and report, they never assert. ``epd bench ...`` registers their commands
(``epd_bench.cli``); each drives the product only through its public interfaces (topology,
deployment, Triton and OpenAI endpoints)."""
