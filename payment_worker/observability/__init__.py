"""Metrics, logs and the exporter."""
