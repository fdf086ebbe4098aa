"""What ops see: Prometheus metrics, structured logs, and the Postgres-state exporter."""
