"""``python -m inferflow.bench``: run the load generator."""

import sys

from inferflow.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
