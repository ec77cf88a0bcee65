"""One simulated scheduler process (one TP rank): holds its GPU, inherits the HTTP socket.

Started by gpusim.sglang_server with the listening socket among its file descriptors, so
the port stays bound while this process lives, like SGLang's schedulers. The launcher
registers this PID's GPU memory in the state directory. Nothing here watches the parent:
when the launcher is SIGKILLed this process keeps running, holding memory and the port,
exactly the orphan the story's operator had to hunt down. SIGTERM/SIGINT end it cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

import setproctitle

from gpusim import state


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpusim.rank")
    parser.add_argument("--gpu", type=int, required=True)
    parser.add_argument("--title", required=True)
    args = parser.parse_args(argv)
    setproctitle.setproctitle(args.title)
    device = open(state.device_path(args.gpu), "rb")  # noqa: SIM115  held for life on purpose
    stop = threading.Event()

    def _stop(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # The launcher waits for this line before it registers memory for this PID.
    print("ready", flush=True)
    while not stop.wait(3600):
        pass
    state.unregister(os.getpid())
    device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
