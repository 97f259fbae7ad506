"""Model checkpoints for tests and benchmarks."""
