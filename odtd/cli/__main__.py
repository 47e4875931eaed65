"""``python -m odtd.cli``: the same as ``odtctl``."""

import sys

from odtd.cli import main

sys.exit(main())
