"""The integration tests' fixtures: real CRIU, the fake GPU, an isolated torpor state."""

from tests.integration.conftest import gpu, reaper, torpor  # noqa: F401
