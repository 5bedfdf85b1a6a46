"""``python -m layoutckpt``: the command line (``layoutckpt --help``)."""

import sys

from ._cli import main

sys.exit(main())
