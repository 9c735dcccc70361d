"""``python -m dcp_datastates``: see :mod:`dcp_datastates.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
