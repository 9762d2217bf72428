"""`python -m kera ...`: the same as the `kera` console script."""

import sys

from kera.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
