"""inferflow's Hydra config tree, importable as ``inferflow.conf`` (``pkg://inferflow.conf``)."""
