"""``python -m tiered_dcp.cli``: the tiered-dcp command."""

import sys

from .main import main

sys.exit(main())
