"""Helpers that drive real container engines (podman, containerd) for tests and benchmarks."""
