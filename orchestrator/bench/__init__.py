"""Benchmarks of the serving stack: they measure and report, they never assert."""
