"""Monitoring: what Prometheus scrapes, the settings the templates print, and the fleet
dashboard (docs/MONITORING.md).

Layers: docs/ARCHITECTURE.md, "Package map"."""
