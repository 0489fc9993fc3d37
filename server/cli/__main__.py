"""`python -m server.cli`: the `canvas` console script."""

import sys

from server.cli import main

sys.exit(main())
