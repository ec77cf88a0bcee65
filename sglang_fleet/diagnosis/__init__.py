"""Why throughput is what it is: verdicts from a smoke result and a server's log, and live
samples of a running server's /metrics (docs/DIAGNOSIS.md).

Layers: docs/ARCHITECTURE.md, "Package map"."""
