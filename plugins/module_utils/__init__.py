"""Code modules ship to GPU hosts
(ansible_collections.sglang_fleet.fleet.plugins.module_utils.<name>); the control-node package
reaches it as sglang_fleet.module_utils (pyproject.toml). Standard library only."""
