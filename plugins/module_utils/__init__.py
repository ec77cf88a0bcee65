"""Code modules ship to GPU hosts (ansible.module_utils.<name>); the control-node package
reaches it as sglang_fleet.module_utils (pyproject.toml). Standard library only."""
