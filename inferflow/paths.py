"""inferflow's own folder: ``$INFERFLOW_HOME`` (default ``~/.cache/inferflow``).

Below it: ``models/`` (the embedded tiny model, preset checkpoints), ``compiled_engines/``
(unless ``$INFERFLOW_ENGINE_DIR``) and ``traces/`` (the default trace file).
"""

from __future__ import annotations

import os
from pathlib import Path


def inferflow_home() -> Path:
    return Path(
        os.environ.get("INFERFLOW_HOME") or Path.home() / ".cache" / "inferflow"
    ).expanduser()
