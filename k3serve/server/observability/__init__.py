"""What the server reports: Prometheus metrics, the periodic stats log, OpenTelemetry spans."""
