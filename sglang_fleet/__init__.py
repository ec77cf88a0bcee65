"""Control-node Python for sglang-fleet: flags, planner, diagnosis, smoke client."""
