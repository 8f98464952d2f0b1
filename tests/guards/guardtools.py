"""Small helpers shared by the light guards tests (a unique module name: no conftest imports)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0.0 when absent."""
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
