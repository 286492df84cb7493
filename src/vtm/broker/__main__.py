"""python -m vtm.broker: the same as the vtmd command (src/_vtmd.py)."""

import _vtmd  # first: it catches SIGTERM and SIGINT
import sys

sys.exit(_vtmd.main())
