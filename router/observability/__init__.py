"""What an operator sees of a router: Prometheus metrics, OpenTelemetry
spans and the status page (static/)."""
