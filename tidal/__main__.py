"""``python -m tidal``: the same as the ``tidal`` command."""

import sys

from tidal.cli.main import main

sys.exit(main())
