"""`gpusim`: set up a simulated host and play the other actors on it.

gpusim init [--gpus N] [--gpu-memory-mib M] [--host-ram-gib G] [--gpu-name NAME] ...
gpusim driver --loaded | --unloaded
gpusim hold --gpu N --mib M [--name NAME]     # a foreign process holding GPU memory
gpusim status
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence

from gpusim import state
from gpusim.state import Hardware, Timing


def _cmd_init(args: argparse.Namespace) -> int:
    hardware = Hardware(
        gpu_count=args.gpus,
        gpu_name=args.gpu_name,
        gpu_memory_mib=args.gpu_memory_mib,
        host_ram_gib=args.host_ram_gib,
        driver_loaded=not args.driver_unloaded,
        driver_version=args.driver_version,
    )
    if args.fast:
        hardware.timing = Timing(
            load_weights_s=0, kv_alloc_s=0, graph_capture_s=0, decode_step_s=0, prefill_token_s=0
        )
    root = state.init_state(hardware)
    print(f"gpusim state initialised at {root}")
    return 0


def _cmd_driver(args: argparse.Namespace) -> int:
    hardware = state.load_hardware()
    hardware.driver_loaded = args.loaded
    state.save_hardware(hardware)
    print(f"driver {'loaded' if args.loaded else 'unloaded'}")
    return 0


def _cmd_hold(args: argparse.Namespace) -> int:
    """Register this process on a GPU, keep its device file open, sleep until killed."""
    if args.name:
        _set_title(args.name)
    device = open(state.device_path(args.gpu), "rb")  # noqa: SIM115  held for life on purpose
    state.register(os.getpid(), args.gpu, args.mib, args.name or "python3")
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"holding {args.mib} MiB on GPU {args.gpu} as pid {os.getpid()}", flush=True)
    while not stop:
        time.sleep(0.2)
    state.unregister(os.getpid())
    device.close()
    return 0


def _set_title(name: str) -> None:
    try:
        import setproctitle  # noqa: PLC0415  optional at this call site only

        setproctitle.setproctitle(name)
    except ImportError:
        pass


def _cmd_status(_: argparse.Namespace) -> int:
    hardware = state.load_hardware()
    procs = state.live_procs()
    used = state.used_mib_by_gpu(hardware, procs)
    print(f"state dir: {state.state_dir()}")
    print(
        f"{hardware.gpu_count} x {hardware.gpu_name}, {hardware.gpu_memory_mib} MiB each, "
        f"host RAM {hardware.host_ram_gib} GiB, driver "
        f"{'loaded' if hardware.driver_loaded else 'NOT loaded'}"
    )
    for index, mib in enumerate(used):
        print(f"  GPU {index}: {mib} / {hardware.gpu_memory_mib} MiB used")
    for proc in procs:
        print(f"  pid {proc.pid} GPU {proc.gpu_index} {proc.used_mib} MiB {proc.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    defaults = Hardware()
    parser = argparse.ArgumentParser(prog="gpusim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init", help="create the state directory and hardware.yaml")
    init.add_argument("--gpus", type=int, default=defaults.gpu_count)
    init.add_argument("--gpu-name", default=defaults.gpu_name)
    init.add_argument("--gpu-memory-mib", type=int, default=defaults.gpu_memory_mib)
    init.add_argument("--host-ram-gib", type=float, default=defaults.host_ram_gib)
    init.add_argument("--driver-version", default=defaults.driver_version)
    init.add_argument("--driver-unloaded", action="store_true")
    init.add_argument("--fast", action="store_true", help="zero every simulated duration")
    init.set_defaults(func=_cmd_init)

    driver = sub.add_parser("driver", help="load or unload the simulated driver")
    group = driver.add_mutually_exclusive_group(required=True)
    group.add_argument("--loaded", action="store_true")
    group.add_argument("--unloaded", dest="loaded", action="store_false")
    driver.set_defaults(func=_cmd_driver)

    hold = sub.add_parser("hold", help="hold GPU memory like a foreign training job")
    hold.add_argument("--gpu", type=int, required=True)
    hold.add_argument("--mib", type=int, required=True)
    hold.add_argument("--name", default=None, help="process title shown by nvidia-smi")
    hold.set_defaults(func=_cmd_hold)

    status = sub.add_parser("status", help="print the simulated host")
    status.set_defaults(func=_cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
