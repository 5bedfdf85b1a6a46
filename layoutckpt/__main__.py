"""``python -m layoutckpt``: the command line (``layoutckpt --help``)."""

import sys

from .cli._main import main

sys.exit(main())
