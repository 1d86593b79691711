"""The root config schema: what ``python -m inferflow`` composes into (:class:`InferflowConfig`).

The config tree (``conf/``, shipped as the package ``inferflow.conf``) composes into
:class:`InferflowConfig`. ``model`` and ``models:`` entries are typed here, ``server`` in
``config/server.py``, ``tracing`` in ``config/tracing.py``; each slot holds a ``_target_`` node
whose schema comes from the stage class (``inferflow.stages.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from inferflow.config.base import ConfigEnum
from inferflow.config.server import ServerConfig
from inferflow.config.tracing import TracingConfig

# The slots of the serving graph, in request order -> where each runs: a "request" slot per
# request before the engine, an "engine" slot shapes the engine, a "response" slot reads the
# engine's output in the API process. Every other slot list
# (REQUEST_SLOTS, ENGINE_SLOTS, RESPONSE_SLOTS, the pipeline default, the slots a ``models:`` entry overrides)
# is derived from this table; InferflowConfig and ModelEntryConfig have one field per slot.
SLOTS: dict[str, str] = {
    "validator": "request",
    "tokenizer": "request",
    "cache": "engine",
    "batching": "engine",
    "speculative": "engine",
    "guided": "engine",
    "lora": "engine",
    "executor": "engine",
    "detokenizer": "engine",
    "reasoning_parser": "response",
    "tool_parser": "response",
}
REQUEST_SLOTS = tuple(name for name, side in SLOTS.items() if side == "request")
ENGINE_SLOTS = tuple(name for name, side in SLOTS.items() if side == "engine")
RESPONSE_SLOTS = tuple(name for name, side in SLOTS.items() if side == "response")


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

    @property
    def is_embedding(self) -> bool:
        """Served on ``/v1/embeddings`` by the API processes (no engine worker)."""
        return ModelTask(self.task) is ModelTask.embed

    @property
    def model_id(self) -> str:
        """``name@version``, what a request pins this version by (an unnamed model, before its
        checkpoint is located, goes by its path or builtin)."""
        return f"{self.name or self.path or self.builtin}@{self.version}"


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
    lora: Any = None
    reasoning_parser: Any = None
    tool_parser: Any = None


class Task(ConfigEnum):
    serve = "serve"  # start the HTTP server (the default)
    check = "check"  # build the graph, set up the request stages, print a summary; no engine
    offline = "offline"  # load the engine, run the synthetic ``offline`` workload, report
    bench = "bench"  # serve this config, drive it with ``experiment.workload``, report, stop


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
class WorkloadConfig:
    """The load of a served measurement (``task=bench``, ``inferflow tune``): the options of
    ``inferflow bench`` (vLLM ``bench serve`` names). ``request_rate`` is req/s (``.inf``: all
    at once, capped by ``max_concurrency``); ``burstiness`` 1 is a Poisson process.
    ``dataset_path``: the prompts of ``dataset=jsonl``; ``range_ratio`` and ``prefix_len`` as
    ``--random-range-ratio`` / ``--random-prefix-len`` (None: the dataset's default)."""

    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int | None = None
    request_rate: float = float("inf")
    max_concurrency: int | None = 16
    burstiness: float = 1.0
    seed: int = 0


@dataclass
class ExperimentConfig:
    """How a measured run (``task=offline`` or ``task=bench``) is made trustworthy: ``warmup``
    unmeasured passes, then ``repeats`` measured ones; a figure whose coefficient of variation
    exceeds ``max_spread`` marks the run as too noisy to compare. ``goodput``: SLOs in ms
    (``ttft``, ``tpot``, ``e2el``), as ``inferflow bench --goodput``. ``servers`` (``task=bench``):
    the repeats are spread over that many fresh servers, each warmed up, so the spread also holds
    how much a new server's level varies."""

    repeats: int = 3
    warmup: int = 1
    max_spread: float = 0.10
    servers: int = 1
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    goodput: dict[str, float] = field(default_factory=dict)
    server_timeout_s: float = 600.0  # task=bench: the served config's start, /ready included

    def __post_init__(self) -> None:
        for name in ("repeats", "servers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "max_spread"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.server_timeout_s > 0:
            raise ValueError(f"server_timeout_s: must be > 0, got {self.server_timeout_s}")


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
    lora: Any = None
    reasoning_parser: Any = None
    tool_parser: Any = None
    pipeline: list[str] = field(default_factory=lambda: list(SLOTS))
    stages: dict[str, Any] = field(default_factory=dict)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    allowed_targets: list[str] = field(default_factory=list)
    task: Task = Task.serve
    offline: OfflineConfig = field(default_factory=OfflineConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
