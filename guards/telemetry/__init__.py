"""What kvguard reports: Prometheus metrics (multiprocess files), structlog events, the
state directory the sidecar reads (fatal records, heartbeats)."""
