"""Deprecated: moved to :mod:`inferflow.testing.fake_server` (a test double, not product).

``python -m inferflow.bench.fake_server`` still runs it, with a DeprecationWarning.
"""

import warnings

from inferflow.testing.fake_server import FakeServer, FakeServerConfig, main

warnings.warn(
    "inferflow.bench.fake_server moved to inferflow.testing.fake_server",
    DeprecationWarning,
    stacklevel=1 if __name__ == "__main__" else 2,  # shown for ``python -m`` too
)

__all__ = ["FakeServer", "FakeServerConfig", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
