"""`python -m flexinfer`: the `flexinfer` command."""

import sys

from flexinfer.cli import main

sys.exit(main())
