"""Describing servers: the inventory resolved into each server's launch line, environment and
files, its checks against the host, nodes across hosts, its model source, its router settings
and what a rollout restarts (docs/INVENTORY.md).

Layers: docs/ARCHITECTURE.md, "Package map"."""
