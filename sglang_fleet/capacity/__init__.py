"""What bounds a server's throughput before it starts: the model's shape, KV-cache arithmetic,
attention-DP layouts, start-up logs and the flags a logged run ran with, calibration, the planner
and its verdict (docs/CALIBRATION.md, docs/ATTENTION-DP.md).

Layers: docs/ARCHITECTURE.md, "Package map"."""
