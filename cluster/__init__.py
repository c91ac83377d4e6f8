"""Wiring: config, the `shoal` CLI and its benchmarks."""
