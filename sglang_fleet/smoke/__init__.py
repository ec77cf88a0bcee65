"""The smoke benchmark: the host-side client (standard library only, copied to hosts), the gate
on its result, the report picture, and what a stop cost (docs/ARCHITECTURE.md).

Layers: docs/ARCHITECTURE.md, "Package map"."""
