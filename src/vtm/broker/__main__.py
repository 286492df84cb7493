"""python -m vtm.broker: the same as the vtmd command."""

import sys

from vtm.broker.vtmd import main

sys.exit(main())
