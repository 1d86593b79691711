"""inferflow's Hydra config tree, importable as ``inferflow.conf`` (``pkg://inferflow.conf``).

Importing it registers the typed schemas the YAML files extend, so any Hydra entry point that
loads ``pkg://inferflow.conf`` (``initialize_config_module("inferflow.conf")``, a custom app)
gets the same typed configs as ``python -m inferflow``. It imports only what registers them.
"""

from inferflow.stages.registry import register_configs

register_configs()
