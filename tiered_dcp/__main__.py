"""``python -m tiered_dcp``: the tiered-dcp command, for a venv whose ``bin/`` is not on
the PATH (the same as ``python -m tiered_dcp.cli`` and the ``tiered-dcp`` script)."""

import sys

from .cli.main import main

sys.exit(main())
