"""``python -m odtd.daemon``: the same as ``odtd``."""

import sys

from odtd.daemon.service import main

sys.exit(main())
