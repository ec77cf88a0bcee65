"""The autotune search on a canary and its picture (docs/AUTOTUNE.md).

Layers: docs/ARCHITECTURE.md, "Package map"."""
