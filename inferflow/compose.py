"""Composing the config: the config tree and its search path (plugins, ``$INFERFLOW_CONFIG_PATH``),
what inferflow does to the command line before Hydra sees it (``prepare_overrides``), and
``compose_config`` (the config ``python -m inferflow OVERRIDES`` would run, for tests, notebooks,
``serve run`` and KubeRay).

The spellings Hydra alone would refuse or list twice: ``+model=x`` for a group with a default,
several ``+stages=NAME``, old key names, and the plugin folders of the config search path.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from inferflow.stages.registry import register_configs

CONF_PACKAGE = "inferflow.conf"
CONF_SOURCE = f"pkg://{CONF_PACKAGE}"
CONFIG_NAME = "config"


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the config as ``python -m inferflow OVERRIDES`` would (tests, notebooks, tools).

    Must not be called inside a running Hydra app (use the ``cfg`` it passes instead).
    """
    register_configs()
    register_resolvers()
    with initialize_config_module(CONF_PACKAGE, version_base="1.3"):
        return compose(CONFIG_NAME, overrides=prepare_overrides(overrides))


# ---------------------------------------------------------------- a sweep's run folders

# a run folder's name past this many characters is cut and ends in a hash of the whole
RUN_DIRNAME_MAX = 120


def run_dirname(overrides: Sequence[str]) -> str:
    """A multirun job's folder name (``hydra.sweep.subdir``, after ``NUM_``): its overrides but
    the measurement's own (``task``, ``experiment.*``: the same for every run of a sweep, and
    in each ``results.json``) and Hydra's, ``/`` read as ``_`` (a value that is a path must not
    nest folders), at most ``RUN_DIRNAME_MAX`` characters (file systems refuse names over 255:
    a longer one keeps its start and a hash of the whole, so runs stay apart)."""
    kept = []
    for item in overrides:
        key = str(item).split("=", 1)[0].lstrip("+~")
        if key in ("task", "experiment") or key.startswith(("experiment.", "hydra.", "hydra/")):
            continue
        kept.append(str(item))
    name = ",".join(kept).replace("/", "_")
    if len(name) > RUN_DIRNAME_MAX:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[: RUN_DIRNAME_MAX - 9]}-{digest}"
    return name


def register_resolvers() -> None:
    """``${inferflow.run_dirname:LIST}`` for ``conf/config.yaml`` (idempotent)."""
    OmegaConf.register_new_resolver("inferflow.run_dirname", run_dirname, replace=True)


# ---------------------------------------------------------------- plugins and the search path


@dataclass(frozen=True)
class Plugin:
    """An installed plugin: ``[project.entry-points."inferflow.plugins"] NAME = "pkg.conf"``.

    The entry point names the plugin's config package (Hydra config groups such as ``stages/``
    or ``batching/``); it joins the config search path, and its parent module (``pkg``) becomes
    an allowed ``_target_`` prefix. Nothing is imported to discover a plugin.
    """

    name: str
    conf_module: str

    @property
    def search_path(self) -> str:
        return f"pkg://{self.conf_module}"

    @property
    def target_prefix(self) -> str:
        module = self.conf_module
        return module[: -len(".conf")] if module.endswith(".conf") else module


def discover_plugins() -> list[Plugin]:
    """Installed plugins (entry point group ``inferflow.plugins``), sorted by name."""
    eps = importlib.metadata.entry_points(group="inferflow.plugins")
    return sorted((Plugin(ep.name, ep.module) for ep in eps), key=lambda p: p.name)


def env_search_paths(environ: Mapping[str, str] | None = None) -> list[str]:
    """``$INFERFLOW_CONFIG_PATH``: folders (or ``pkg://``/``file://`` URLs), ``os.pathsep``-separated;
    then ``$INFERFLOW_HOME/conf`` when it exists (where ``inferflow tune`` writes
    ``tuned/NAME.yaml``, selected with ``+tuned=NAME``)."""
    env = os.environ if environ is None else environ
    raw = env.get("INFERFLOW_CONFIG_PATH", "")
    items = filter(None, (p.strip() for p in raw.split(os.pathsep)))
    urls = ("pkg://", "file://")
    paths = [i if i.startswith(urls) else f"file://{Path(i).expanduser().resolve()}" for i in items]
    home = home_conf_dir(env)
    if home.is_dir() and f"file://{home}" not in paths:
        paths.append(f"file://{home}")
    return paths


def home_conf_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$INFERFLOW_HOME/conf``: the user's own config groups (``tuned/`` from ``inferflow tune``)."""
    env = os.environ if environ is None else environ
    home = env.get("INFERFLOW_HOME") or Path.home() / ".cache" / "inferflow"
    return Path(home).expanduser().resolve() / "conf"


# ---------------------------------------------------------------- the command line

# Hydra's flags that take a value (``--cfg job``); ``--info`` takes one of _INFO optionally.
_VALUE_FLAGS = frozenset({
    "--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
    "--config-dir", "-cd", "--experimental-rerun",
})
_INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def split_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, overrides): an override never starts with ``-``."""
    flags: list[str] = []
    overrides: list[str] = []
    takes_value = False
    for arg in args:
        if takes_value:
            flags.append(arg)
            takes_value = False
        elif arg.startswith("-"):
            flags.append(arg)
            takes_value = arg in _VALUE_FLAGS
        elif flags and flags[-1] in ("--info", "-i") and arg in _INFO:
            flags.append(arg)
        else:
            overrides.append(arg)
    return flags, overrides


def defaulted_groups() -> list[str]:
    """Groups that have a default in ``conf/config.yaml`` (``+group=x`` is rewritten for them)."""
    text = importlib.resources.files(CONF_PACKAGE).joinpath(f"{CONFIG_NAME}.yaml").read_text()
    defaults = yaml.safe_load(text).get("defaults", [])
    return [
        next(iter(d))
        for d in defaults
        if isinstance(d, dict) and not next(iter(d)).startswith(("override ", "hydra/"))
    ]


# Keys of a dict that names its own entries (``lora.adapters.NAME=PATH``): set with ``++`` so
# that no ``+`` is needed for a new entry, and a given one is replaced (both spellings work).
OPEN_DICT_KEY = re.compile(r"(?:models\.[^.=]+\.)?lora\.adapters\.[^.=]+")

# Old spelling -> the key's name now (vLLM's names); the old one keeps working on the command line.
RENAMED_KEYS = {"batching.max_batch_size": "batching.max_num_seqs"}


def prepare_overrides(
    overrides: Sequence[str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """What inferflow does to the command line before Hydra sees it.

    1. ``+model=x`` -> ``model=x`` for groups that have a default (plain Hydra rejects ``+`` on
       them), so both spellings select another model while the default still applies.
    2. Plugin config packages and ``$INFERFLOW_CONFIG_PATH`` join ``hydra.searchpath`` (after
       any entries the user passed in ``hydra.searchpath=[...]``). The Hydra plugin
       ``hydra_plugins.inferflow_searchpath`` adds the same folders at start-up (which is what
       puts their options in ``--help``); this keeps them when that plugin is not importable.
       A folder that plugin already adds is not passed again (``--info searchpath`` lists
       each once).
    3. Old key spellings (:data:`RENAMED_KEYS`) become the new ones, with a FutureWarning, so
       ``--cfg job`` shows the value under the name that is in effect.
    4. Several ``+stages=NAME`` (or ``stages=NAME``) become one ``+stages=[A,B]``: Hydra takes
       one value per group, and each name adds one entry to the ``stages:`` dict.
    5. ``lora.adapters.NAME=PATH`` (:data:`OPEN_DICT_KEY`) -> ``++lora.adapters.NAME=PATH``:
       an adapter is a new key of that dict, which Hydra's struct mode refuses without ``+``.
    """
    groups = set(defaulted_groups())
    out: list[str] = []
    user_paths: list[str] = []
    for item in merge_stage_overrides(overrides):
        key, sep, value = item.partition("=")
        if sep and key.startswith("+") and not key.startswith("++") and key[1:] in groups:
            item = f"{key[1:]}={value}"
        if sep and OPEN_DICT_KEY.fullmatch(key.removeprefix("+")) and not key.startswith("++"):
            item = f"++{key.removeprefix('+')}={value}"
        if sep and key in RENAMED_KEYS:
            warnings.warn(
                f"{key} is deprecated: use {RENAMED_KEYS[key]}", FutureWarning, stacklevel=2
            )
            item = f"{RENAMED_KEYS[key]}={value}"
        if sep and key == "hydra.searchpath":
            user_paths = _parse_list_override(item)
            continue
        out.append(item)
    plugin_paths = [p.search_path for p in discover_plugins()]
    added = env_search_paths() + plugin_paths if _searchpath_plugin_active() else []
    paths = [
        p
        for p in dict.fromkeys(user_paths + env_search_paths(environ) + plugin_paths)
        if p not in added
    ]
    if paths:
        quoted = ",".join("'" + p.replace("\\", "\\\\").replace("'", "\\'") + "'" for p in paths)
        out.append(f"hydra.searchpath=[{quoted}]")
    return out


def _searchpath_plugin_active() -> bool:
    """Whether Hydra runs ``hydra_plugins.inferflow_searchpath`` (it adds the plugin folders)."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    return any(
        p.__module__ == "hydra_plugins.inferflow_searchpath"
        for p in Plugins.instance().discover(SearchPathPlugin)
    )


STAGES_GROUP = "stages"


def merge_stage_overrides(overrides: Sequence[str]) -> list[str]:
    """``+stages=a +stages=b`` (or ``stages=a``, ``+stages=[a,b]``) -> one ``+stages=[a,b]``, at
    the first one's place, names in order, each once. One ``+stages=x`` stays as it is; a sweep
    (``+stages=a,b`` under ``-m``) or anything else that is not names is left to Hydra."""
    names: list[str] = []
    out: list[str] = []
    first, count, plain = -1, 0, False
    for item in overrides:
        key, sep, _ = item.partition("=")
        found = _stage_names(item) if sep and key.lstrip("+") == STAGES_GROUP else None
        if found is None or key.startswith("++"):
            out.append(item)
            continue
        if first < 0:
            first = len(out)
            out.append(item)
        count, plain = count + 1, plain or not key.startswith("+")
        names += [n for n in found if n not in names]
    if count > 1 or plain:
        out[first] = f"+{STAGES_GROUP}=[{','.join(names)}]"
    return out


def _stage_names(item: str) -> list[str] | None:
    """The option names of a ``stages`` group override (``a`` or ``[a,b]``), else None."""
    try:
        value = OverridesParser.create().parse_override(item).value()
    except Exception:  # (a parse error is Hydra's to report, in its own words)
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _parse_list_override(item: str) -> list[str]:
    value = OverridesParser.create().parse_override(item).value()
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]
