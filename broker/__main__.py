"""`python -m kera.broker --coordinator HOST:PORT ...` (the same as `kera broker ...`)."""

import sys

from kera.broker.server import main

sys.exit(main())
