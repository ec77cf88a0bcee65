"""``python -m sglang_fleet.smoke.smoke_client``: runs the command line (command_line.main)."""

from __future__ import annotations

import sys

from sglang_fleet.smoke.smoke_client.command_line import main

if __name__ == "__main__":
    sys.argv[0] = "python -m sglang_fleet.smoke.smoke_client"  # argparse names the program so
    sys.exit(main())
