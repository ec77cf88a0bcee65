"""Action sglang_host_program: put one of sglang_fleet's host-side programs on a host as one
file, a zipapp built on the control node from the package's sources
(sglang_fleet/host_zipapp.py; docs/ARCHITECTURE.md, "Host-side programs").

    - name: Put the sampler on the host
      sglang_host_program:
        entry: sglang_fleet.diagnosis.live_metrics   # the module whose main() runs
        dest: /usr/local/lib/sglang-fleet/live.pyz
        mode: "0755"

    - name: Put the job runner on the job's host (its virtualenv holds prometheus_client)
      sglang_host_program:
        entry: sglang_fleet.job.command_line
        requires: [prometheus_client]   # third-party packages the host provides
        dest: /usr/local/lib/sglang-fleet/job.pyz

The archive is built in memory, written to a private temporary folder of the control node
and handed to ansible.builtin.copy (as ansible.builtin.template hands over what it renders),
so check mode, `changed` and owner/group/mode behave as they do for copy: the same sources
give the same bytes, and a host that has them is not changed. Run it with the host's python3:
``python3 live.pyz --help`` (a program with `requires`: with a python that has them). The
result adds `size`, `requires` (the third-party packages the program imports, which the host
must have) and `optional` (those it imports only if they are there).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ansible import constants as C
from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.host_zipapp import ZipappError, build, scan
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
else:
    PACKAGE_ERROR = None

# What copy is given besides src and dest; anything else is refused by name.
PASSED_TO_COPY = ("mode", "owner", "group")


class ActionModule(ActionBase):
    TRANSFERS_FILES = True
    _VALID_ARGS = frozenset(("entry", "dest", "requires", *PASSED_TO_COPY))
    _requires_connection = True
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = self._task.args
        for name in ("entry", "dest"):
            if not isinstance(args.get(name), str) or not args[name]:
                raise AnsibleActionFail(f"sglang_host_program: `{name}` is required (a string)")
        entry, dest = args["entry"], args["dest"]
        if not entry.startswith("sglang_fleet."):
            raise AnsibleActionFail(
                f"sglang_host_program: entry {entry!r} must be a module of sglang_fleet"
            )
        requires = args.get("requires") or []
        if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
            raise AnsibleActionFail("sglang_host_program: `requires` must be a list of names")
        try:
            program = scan(entry, requires)
            data = build(entry, requires)
        except (ZipappError, ImportError, SyntaxError) as exc:
            raise AnsibleActionFail(f"sglang_host_program: {entry}: {exc}") from None
        local_tmp = tempfile.mkdtemp(dir=C.DEFAULT_LOCAL_TMP)
        try:
            source = Path(local_tmp) / Path(dest).name
            source.write_bytes(data)
            copy_task = self._task.copy()
            copy_task.args = {
                "src": str(source),
                "dest": dest,
                **{key: args[key] for key in PASSED_TO_COPY if key in args},
            }
            copy = self._shared_loader_obj.action_loader.get(
                "ansible.legacy.copy",
                task=copy_task,
                connection=self._connection,
                play_context=self._play_context,
                loader=self._loader,
                templar=self._templar,
                shared_loader_obj=self._shared_loader_obj,
            )
            copied = copy.run(task_vars=task_vars)
        finally:
            shutil.rmtree(local_tmp, ignore_errors=True)
            self._remove_tmp_path(self._connection._shell.tmpdir)
        result.update(copied)
        result["size"] = len(data)
        result["requires"] = sorted(program.required)
        result["optional"] = sorted(program.optional)
        return result
