"""Hydra search-path plugin: inferflow's plugin config folders join the search path at start.

Hydra finds this module through the ``hydra_plugins`` namespace package. It adds, for
inferflow's own app only, the config packages of installed inferflow plugins (entry point group
``inferflow.plugins``) and the ``$INFERFLOW_CONFIG_PATH`` folders, so their options are
everywhere Hydra looks, ``--help``'s list of config groups included.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

INFERFLOW_CONF = "pkg://inferflow.conf"


class InferflowSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if not any(e.path == INFERFLOW_CONF for e in search_path.get_path()):
            return  # another Hydra app
        from inferflow.compose import discover_plugins, env_search_paths

        known = {e.path for e in search_path.get_path()}
        for path in [*env_search_paths(), *(p.search_path for p in discover_plugins())]:
            if path not in known:
                search_path.append(provider="inferflow-plugins", path=path)
                known.add(path)
