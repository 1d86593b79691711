"""Typed config schemas of the serving graph, registered in Hydra's ConfigStore.

The config tree (``conf/``, shipped as the package ``inferflow.conf``) composes into
:class:`InferflowConfig`. Built-in stage options get their schema from the stage class itself
(its dataclass fields + ``_target_``), so a bad value or an unknown key fails at composition
with the key's name. ``model``, ``server`` and ``tracing`` are typed here; the server and the
tracing setup read them from ``ServingGraph.server`` / ``ServingGraph.tracing``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from inferflow.config.server import LogLevel, RayServerConfig, ServerConfig, ServerRuntime
from inferflow.config.tracing import OtlpProtocol, TracingConfig, TracingExporter
from inferflow.stages.base import ConfigEnum, PassThroughStage
from inferflow.stages.batching import (
    ContinuousBatching,
    DynamicBatching,
    NoBatching,
    StaticBatching,
)
from inferflow.stages.cache import NoPrefixCache, PrefixCache
from inferflow.stages.detokenizer import StreamingDetokenizer
from inferflow.stages.executor import OnnxRuntimeExecutor, TensorRTExecutor
from inferflow.stages.guided import LLGuidanceDecoding, NoGuidedDecoding
from inferflow.stages.speculative import NgramSpeculation, NoSpeculation
from inferflow.stages.tokenizer import CheckpointTokenizer
from inferflow.stages.torch_executor import TorchExecutor
from inferflow.stages.validator import RequestValidator

# re-exported: the schemas of `tracing` and `server`
__all__ = ["LogLevel", "OtlpProtocol", "RayServerConfig", "ServerConfig", "ServerRuntime", "TracingConfig",
           "TracingExporter"]

CONF_PACKAGE = "inferflow.conf"
CONF_SOURCE = f"pkg://{CONF_PACKAGE}"
CONFIG_NAME = "config"

# Slot name -> kind. Request slots run per request; engine slots shape the engine.
REQUEST_SLOTS = ("validator", "tokenizer")
ENGINE_SLOTS = ("cache", "batching", "speculative", "guided", "executor", "detokenizer")
SLOTS = REQUEST_SLOTS + ENGINE_SLOTS

# Built-in options of each slot group -> the class its conf/<group>/<option>.yaml instantiates.
BUILTIN_OPTIONS: dict[str, dict[str, type]] = {
    "validator": {"default": RequestValidator, "none": PassThroughStage},
    "tokenizer": {"default": CheckpointTokenizer},
    "cache": {"prefix": PrefixCache, "none": NoPrefixCache},
    "batching": {
        "none": NoBatching,
        "static": StaticBatching,
        "dynamic": DynamicBatching,
        "continuous": ContinuousBatching,
    },
    "executor": {
        "onnxruntime": OnnxRuntimeExecutor,
        "tensorrt": TensorRTExecutor,
        "torch": TorchExecutor,
    },
    "detokenizer": {"default": StreamingDetokenizer},
    "guided": {"llguidance": LLGuidanceDecoding, "none": NoGuidedDecoding},
    "speculative": {"none": NoSpeculation, "ngram": NgramSpeculation},
}


class ModelTask(ConfigEnum):
    generate = "generate"
    embed = "embed"  # encoder models (e.g. all-MiniLM-L6-v2) served on /v1/embeddings


@dataclass
class ModelConfig:
    """Which model is served and where its checkpoint is (architecture: the checkpoint's
    ``config.json``).

    Lookup order: ``path`` if set; else ``builtin`` (generated on first use); else
    ``models_dir/dirname``, then the Hugging Face cache snapshot of ``hf_repo`` (read only,
    nothing is downloaded). ``name`` is the id served on ``/v1/models`` (default: the
    checkpoint folder's name). ``max_model_len`` caps the context (default: the checkpoint's).
    ``version`` and ``weight`` matter when several entries share a ``name`` (``extra_models``):
    ``name@version`` pins one, a plain ``name`` picks one with probability proportional to its
    ``weight`` (canary). ``task=embed`` serves the model on ``/v1/embeddings``.
    ``generation_config``: request defaults from ``generation_config.json`` (vLLM's
    ``--generation-config``): ``auto`` reads the checkpoint's, ``none`` nothing, else a folder
    holding one (``inferflow/models/generation_config.py``).
    """

    name: str | None = None
    path: str | None = None
    dirname: str | None = None
    models_dir: str | None = "${oc.env:INFERFLOW_MODELS_DIR,null}"  # None: $INFERFLOW_HOME/models
    hf_repo: str | None = None
    builtin: str | None = None
    max_model_len: int | None = None
    task: ModelTask = ModelTask.generate
    version: str = "1"
    weight: float = 1.0
    generation_config: str = "auto"  # auto | none | a folder holding generation_config.json

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"weight: must be >= 0, got {self.weight}")
        gen = self.generation_config
        if gen not in ("auto", "none") and not (
            Path(gen).expanduser() / "generation_config.json"
        ).is_file():
            raise ValueError(
                f"generation_config: must be auto, none or a folder holding "
                f"generation_config.json, got {gen!r}"
            )


class LoadMode(ConfigEnum):
    eager = "eager"  # loaded at start-up; /ready waits for it
    on_demand = "on_demand"  # loaded on its first request, unloaded when memory is needed


@dataclass
class ModelEntryConfig:
    """One entry of the model repository (``models:``; ``inferflow.graph.repository``).

    ``model``: what it serves (null: the top-level ``model``); its ``name``/``version``/``weight``
    place it in a canary split. Each slot key (``executor``, ``batching``, ...) is merged onto
    the top-level slot of that name, or replaces it when it names another ``_target_``.
    """

    model: ModelConfig | None = None
    load: LoadMode = LoadMode.eager
    validator: Any = None
    tokenizer: Any = None
    cache: Any = None
    batching: Any = None
    executor: Any = None
    detokenizer: Any = None
    guided: Any = None
    speculative: Any = None


class Task(ConfigEnum):
    serve = "serve"  # start the HTTP server (the default)
    check = "check"  # build the graph, set up the request stages, print a summary; no engine
    offline = "offline"  # load the engine, run the synthetic ``offline`` workload, report


@dataclass
class OfflineConfig:
    """Synthetic workload of ``task=offline`` (experiments): ``num_prompts`` random prompts of
    ``prompt_len`` tokens, greedy, ``max_tokens`` each, all submitted at once."""

    num_prompts: int = 16
    prompt_len: int = 32
    max_tokens: int = 16
    seed: int = 0
    output: str | None = None  # results JSON; in multirun defaults to <job dir>/results.json


@dataclass
class InferflowConfig:
    """The root config. Slots hold a ``_target_`` node (or null when removed with ``~slot``)."""

    model: ModelConfig = MISSING
    # More models served beside ``model`` (``+extra_models=minilm``): key -> model entry.
    extra_models: dict[str, ModelConfig] = field(default_factory=dict)
    # the model repository: NAME -> ModelEntryConfig (checked by inferflow.graph.repository;
    # typed Any so that `+models.NAME.model.path=...` can create an entry from the command line)
    models: dict[str, Any] = field(default_factory=dict)
    validator: Any = None
    tokenizer: Any = None
    cache: Any = None
    batching: Any = None
    executor: Any = None
    detokenizer: Any = None
    guided: Any = None
    speculative: Any = None
    pipeline: list[str] = field(default_factory=lambda: list(SLOTS))
    stages: dict[str, Any] = field(default_factory=dict)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    allowed_targets: list[str] = field(default_factory=list)
    task: Task = Task.serve
    offline: OfflineConfig = field(default_factory=OfflineConfig)


def target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def stage_schema(cls: type, target: str | None = None) -> type:
    """A dataclass with ``_target_`` (default: ``cls``'s import path) + ``cls``'s init fields,
    types resolved, so OmegaConf can check values and reject unknown keys."""
    specs: list[tuple[str, Any, Any]] = [("_target_", str, field(default=target or target_of(cls)))]
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = field(default=f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = field(default_factory=f.default_factory)
            else:
                default = field(default=MISSING)
            specs.append((f.name, hints[f.name], default))
    schema = dataclasses.make_dataclass(f"{cls.__name__}Schema", specs)
    schema.__module__ = cls.__module__
    return schema


def schema_name(group: str, option: str) -> str:
    """ConfigStore name of a built-in option's schema (a root-level config, so it is not listed
    as a selectable group option): referenced as ``- /<name>@_here_`` in the option's YAML."""
    return f"{group}_{option}_schema"


def register_configs(store: ConfigStore | None = None) -> None:
    """Store the root schema and every built-in option's schema (idempotent)."""
    cs = store or ConfigStore.instance()
    cs.store(name="inferflow_schema", node=InferflowConfig)
    cs.store(name=schema_name("server", "ray"), node=RayServerConfig)
    for group, options in BUILTIN_OPTIONS.items():
        for option, cls in options.items():
            cs.store(name=schema_name(group, option), node=stage_schema(cls))


class ConfigError(ValueError):
    """A config problem the user can fix; ``str()`` is one line naming the key (exit code 2)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


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
    """``$INFERFLOW_CONFIG_PATH``: folders (or ``pkg://``/``file://`` URLs), ``os.pathsep``-separated."""
    raw = (os.environ if environ is None else environ).get("INFERFLOW_CONFIG_PATH", "")
    paths = []
    for item in filter(None, (p.strip() for p in raw.split(os.pathsep))):
        if item.startswith(("pkg://", "file://")):
            paths.append(item)
        else:
            paths.append("file://" + str(Path(item).expanduser().resolve()))
    return paths


# ---------------------------------------------------------------- one-line error messages

_CONVERT = re.compile(r"Value '(.*)' of type '.*' could not be converted to (\w+)")
_ENUM = re.compile(r"Invalid value '(.*)', expected one of \[(.*)\]")
_EXPECTED = {
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "String": "a string",
}


def describe_omegaconf_error(exc: OmegaConfBaseException, prefix: str = "") -> ConfigError:
    """One line naming the key and what is allowed, from an OmegaConf validation/key error."""
    full_key = f"{prefix}{getattr(exc, 'full_key', None) or ''}".rstrip(".") or "config"
    first = str(getattr(exc, "msg", None) or exc).splitlines()[0]
    if m := _ENUM.match(first):
        return ConfigError(f"{full_key}: invalid value '{m[1]}'; allowed values: {m[2]}", full_key)
    if m := _CONVERT.match(first):
        expected = _EXPECTED.get(m[2], m[2].lower())
        return ConfigError(f"{full_key}: invalid value '{m[1]}'; expected {expected}", full_key)
    if isinstance(exc, ConfigKeyError | ConfigAttributeError) and first.startswith("Key "):
        parent = getattr(exc, "parent_node", None)
        keys = [k for k in parent if k != "hydra"] if isinstance(parent, DictConfig) else []
        allowed = f"; allowed keys: {', '.join(map(str, keys))}" if keys else ""
        if (
            isinstance(parent, DictConfig)
            and OmegaConf.get_type(parent) is dict
            and "." in full_key
        ):
            allowed += f" (to add a key to this dict: +{full_key}=VALUE)"
        return ConfigError(f"{full_key}: unknown key{allowed}", full_key)
    if isinstance(exc, MissingMandatoryValue):
        return ConfigError(f"{full_key}: a value is required (pass {full_key}=...)", full_key)
    return ConfigError(f"{full_key}: {first}", full_key)
