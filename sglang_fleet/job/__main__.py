"""`python -m sglang_fleet.job`: the job runner's command line (command_line.py)."""

import sys

from sglang_fleet.job.command_line import main

sys.exit(main())
