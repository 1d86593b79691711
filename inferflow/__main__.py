"""``python -m inferflow [OVERRIDES]``: compose the config and serve (see inferflow.cli)."""

import sys

from inferflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
