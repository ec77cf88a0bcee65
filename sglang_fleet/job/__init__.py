"""The job runner: a file of prompts through the fleet, every row exactly once (docs/JOB.md)."""
