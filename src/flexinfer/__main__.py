"""`python -m flexinfer`: the `flexinfer` command."""

import sys

from flexinfer.cli import run

sys.exit(run())
