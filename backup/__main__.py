"""`python -m kera.backup --coordinator HOST:PORT --dir DIR`: run one backup daemon."""

import sys

from kera.backup.server import main

if __name__ == "__main__":
    sys.exit(main())
