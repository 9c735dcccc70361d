"""``python -m dcp_datastates``: see :mod:`dcp_datastates._cli`."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
