"""Tiny checkpoints in the real formats, for tests, benchmarks and the bundled default."""
