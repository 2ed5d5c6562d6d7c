"""`python -m streamsync`: the command line (see streamsync.cli)."""

import sys

from .cli import main

sys.exit(main())
