"""One simulated scheduler process (one TP rank): holds its GPU, inherits the HTTP socket.

The launcher forks it after binding the HTTP port, so the listening socket is among its
file descriptors and the port stays bound while this process lives, like SGLang's
schedulers. The launcher registers this PID's GPU memory in the state directory. Nothing
here watches the parent: when the launcher is SIGKILLed this process keeps running,
holding memory and the port, exactly the orphan the Kimi job's operator had to hunt down
(docs/THE-JOB.md).
SIGTERM and SIGINT end it cleanly (unregistered, device file closed). After SIGTERM it then
dies of that signal (exit code -15 to its parent), as a scheduler without a SIGTERM handler
does; SIGINT is how the launcher stops it on SGLang's ShutdownReq: exit code 0.
"""

from __future__ import annotations

import os
import signal
from typing import NoReturn

import setproctitle

from gpusim import state


def spawn(gpu: int, title: str) -> int:
    """Fork a rank process; return its PID once it has its title and holds its GPU."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _run(gpu, title, ready_w)
    os.close(ready_w)
    os.read(ready_r, 1)  # the child writes one byte when set up (or dies: EOF)
    os.close(ready_r)
    return pid


def _run(gpu: int, title: str, ready_fd: int) -> NoReturn:
    code = 0
    stopped_by = 0
    try:
        setproctitle.setproctitle(title)

        def _stop(signum: int, frame: object) -> None:
            nonlocal stopped_by
            stopped_by = signum

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        with open(state.device_path(gpu), "rb"):
            os.write(ready_fd, b"1")
            os.close(ready_fd)
            while not stopped_by:
                signal.pause()
        state.unregister(os.getpid())
        if stopped_by == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
    except BaseException:  # a forked child must never return into the launcher's code
        code = 1
    os._exit(code)
