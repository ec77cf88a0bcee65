"""The collection's own modules and actions by their fully qualified names.

An action plugin that runs a module or another action names it for Ansible's loaders, and a
short name resolves only through the folders a checkout's ansible.cfg lists (library,
action_plugins): an installed collection has none of them, and a role's collection is not
searched for a plugin an action names (docs/COLLECTION.md, "How a checkout finds itself by
FQCN"). Every name the actions pass is made fully qualified here; a name with a dot already is
(ansible.legacy.command, ansible.builtin.slurp) and stays as it is.
"""

from __future__ import annotations

NAME = "sglang_fleet.fleet"


def fqcn(plugin: str) -> str:
    """`plugin` as Ansible's loaders find it from a checkout and from an installed collection."""
    return plugin if "." in plugin else f"{NAME}.{plugin}"
