"""Build the serving graph from a composed config.

``build_graph(cfg)`` is cheap and side-effect free apart from locating the checkpoint (the
embedded tiny model is generated on first use): LitServe workers call it again from the plain
dict (``graph.to_container()``). Expensive work happens later: ``setup_stages()`` loads the
tokenizer, ``create_engine()`` loads the weights and builds or loads the compiled engine.

Each stage is built from its node by ``inferflow.graph.targets`` (the ``_target_`` allowlist, typed
config keys, the slot's contract); this module places the stages on their side of the engine
and computes the engine's layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from inferflow.config.base import ConfigError, describe_omegaconf_error, typed_config
from inferflow.config.schema import ENGINE_SLOTS, REQUEST_SLOTS, SLOTS, ModelConfig
from inferflow.config.server import RayServerConfig, ServerConfig
from inferflow.config.tracing import TracingConfig
from inferflow.graph.order import place_stages, splice_order
from inferflow.graph.repository import RepositoryEntry, plain_dict
from inferflow.graph.targets import allowed_prefixes, instantiate_stage
from inferflow.models.lookup import resolve_model
from inferflow.stages.base import RequestStage, StageContext, StageRequest
from inferflow.stages.batching import BatchingStage, NoBatching
from inferflow.stages.cache import CacheStage, NoPrefixCache
from inferflow.stages.detokenizer import DetokenizerStage, StreamingDetokenizer
from inferflow.stages.engine_slot import EngineStage
from inferflow.stages.executor import ExecutorStage
from inferflow.stages.guided import GuidedDecodingStage, NoGuidedDecoding
from inferflow.stages.lora import LoraStage
from inferflow.stages.reasoning_parser import AutoReasoningParser, ReasoningParserStage
from inferflow.stages.response import ResponseStage
from inferflow.stages.speculative import NoSpeculation, SpeculativeStage
from inferflow.stages.tool_parser import AutoToolParser, ToolParserStage

if TYPE_CHECKING:
    from inferflow.engine.llm_engine import ExecutorWrapper, LLMEngine
    from inferflow.lora.registry import LoraRegistry
    from inferflow.models.config import ModelArch
    from inferflow.models.tokenizer import Tokenizer
    from inferflow.scheduling.kv_budget import ServedContext
    from inferflow.scheduling.layout import KVLayout

# What to change when the scheduler refuses a budget (appended to its one-line error).
_ADVICE = {
    "max_num_batched_tokens": (
        " (raise batching.max_num_batched_tokens, lower batching.max_num_seqs, or keep"
        " batching.enable_chunked_prefill=true)"
    ),
    "max_num_seqs": " (batching.max_num_seqs)",
    "long_prefill_token_threshold": " (batching.long_prefill_token_threshold)",
}

# Engine-side slot -> the contract its _target_ must implement (each contract names its slot).
ENGINE_STAGE_KINDS: dict[str, type[EngineStage]] = {
    contract.kind: contract
    for contract in (CacheStage, BatchingStage, ExecutorStage, DetokenizerStage,
                     GuidedDecodingStage, SpeculativeStage, LoraStage)
}
# Response-side slot -> its contract (read the engine's output in the API process; a removed
# slot, ``~tool_parser``, holds the default: ``auto``).
RESPONSE_SLOT_KINDS: dict[str, type] = {
    contract.kind: contract for contract in (ReasoningParserStage, ToolParserStage)
}


@dataclass
class ServingGraph:
    """The composed server: request stages, engine-side stages, response stages, frontend config.

    ``request_stages`` run per request before the engine and ``response_stages`` on its output
    (call ``setup_stages()`` once per process first, or let ``process()`` do it). The engine-side
    stages (``batching``, ``cache``, ``guided``, ``executor``, ``detokenizer``) are the components
    ``create_engine()`` assembles; a removed slot (``~cache``) holds its null implementation.
    ``config`` is the resolved config (``model.path``/``model.name`` filled in);
    ``to_container()`` is its plain-dict form for worker processes.
    """

    model_name: str
    model_path: Path
    model: ModelConfig
    request_stages: list[RequestStage]
    batching: BatchingStage
    cache: CacheStage
    executor: ExecutorStage
    detokenizer: DetokenizerStage
    server: ServerConfig
    tracing: TracingConfig
    config: DictConfig
    response_stages: list[ResponseStage] = field(default_factory=list)
    guided: GuidedDecodingStage = field(default_factory=NoGuidedDecoding)
    speculative: SpeculativeStage = field(default_factory=NoSpeculation)
    lora: LoraStage = field(default_factory=LoraStage)  # (no adapters: LoRA off)
    reasoning_parser: ReasoningParserStage = field(default_factory=AutoReasoningParser)
    tool_parser: ToolParserStage = field(default_factory=AutoToolParser)
    present_slots: tuple[str, ...] = ENGINE_SLOTS
    _context: StageContext | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @functools.cached_property
    def served_context(self) -> ServedContext:
        """``model.max_model_len`` capped by the checkpoint's limit and by what the executor's
        KV budget holds (``scheduling/kv_budget.py``); a budget too small is a ConfigError."""
        from inferflow.models.safetensors_reader import iter_shards
        from inferflow.scheduling.config import blocks_per_window
        from inferflow.scheduling.kv_budget import paged_context, served_context, weights_bytes

        arch = self.model_arch
        limit = arch.max_position_embeddings
        wanted = min(limit, self.model.max_model_len or limit)
        size, blocks = self.cache.block_size, self.cache.num_blocks
        try:
            budget = None
            if not self.model.is_embedding:
                budget = self.executor.kv_budget(arch, weights_bytes(iter_shards(self.model_path)))
            if not self.executor.pages_kv:
                return served_context(wanted, self.max_slots, size, blocks, budget)
            need = blocks_per_window(self.kv_window, size, self.batching)
            return paged_context(wanted, self.max_slots, size, blocks, budget, need or 0)
        except ValueError as exc:
            raise ConfigError(str(exc), "executor.kv_cache_memory") from None

    @property
    def kv_window(self) -> int | None:
        """The model's sliding window when every layer has one (the layout's ``sliding_window``)."""
        from inferflow.scheduling.layout import kv_window

        return kv_window(self.model_arch.layer_windows)

    @functools.cached_property
    def model_arch(self) -> ModelArch:
        """The checkpoint's architecture (its config.json); a checkpoint inferflow cannot serve
        as transformers would is a ConfigError naming the file, the field and its value."""
        from inferflow.models.config import parse_model_config

        with _checkpoint_errors():
            return parse_model_config(self.model_path / "config.json")

    def check_checkpoint(self) -> None:
        """Refuse, in one line, a checkpoint the engine worker would refuse: config.json (see
        ``model_arch``), missing files, tensors missing, misshaped or unused (read from the
        files' headers), no tokenizer, a model the executors do not compute yet."""
        from inferflow.models.checkpoint import Checkpoint

        with _checkpoint_errors():  # (the worker's load_checkpoint logs what is not applied)
            checkpoint = Checkpoint(self.model_path, self.model.generation_config)
            checkpoint.open_weights().close()
            _ = self.tokenizer
            checkpoint.config.check_context(
                self.model_path / "config.json", self.max_model_len, "model.max_model_len")
        self.check_lora_adapters()

    def served_model_names(self) -> set[str]:
        """The names requests select models by: this model's, ``extra_models``' and the model
        repository's (``models:``) entries'."""
        from inferflow.graph.repository import repository_entries

        models = [typed_config(ModelConfig, node, f"extra_models.{key}")
                  for key, node in (self.config.get("extra_models") or {}).items()]
        if self.config.get("models"):
            models += [entry.model for entry in repository_entries(self.config)]
        names = {self.model_name}
        for model in models:
            try:
                names.add(model.name or resolve_model(model)[1])
            except ConfigError:
                continue  # (a checkpoint not there: that entry's own error, where it loads)
        return names

    def check_lora_adapters(self) -> None:
        """Read and check every ``lora.adapters`` folder as the engine will (one line naming
        ``lora.adapters.NAME`` and the problem; nothing stays loaded)."""
        spec = self.lora.spec()
        if spec is None:
            return
        from inferflow.lora.adapter import LoraError, load_peft_adapter

        for name, path in self.lora.adapters.items():
            try:
                load_peft_adapter(Path(path).expanduser(), name, self.model_arch, spec,
                                  field_name=f"lora.adapters.{name}")
            except LoraError as exc:
                raise ConfigError(str(exc), exc.field) from None

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer, loaded once per process (the check and the stages)."""
        from inferflow.models.tokenizer import Tokenizer

        with _checkpoint_errors():
            return Tokenizer(self.model_path)

    @property
    def max_slots(self) -> int:
        """Sequences the engine runs at once: the executor's slots, else ``batching.max_num_seqs``."""
        return self.executor.max_slots or self.batching.max_num_seqs

    @property
    def max_model_len(self) -> int:
        """Served context length (see ``served_context``)."""
        return self.served_context.served

    def kv_budget_note(self) -> str | None:
        """One line when the KV budget lowered the served context (else None)."""
        return self.served_context.note()

    def notes(self) -> list[str]:
        """What a start says once (a warning; ``task=check``: ``note:`` lines): the KV budget's
        note and the executor's (an ``auto`` that fell back on this machine)."""
        if self.model.is_embedding:
            return []
        return [n for n in (self.kv_budget_note(), self.executor.layout_note()) if n is not None]

    def to_container(self) -> dict[str, Any]:
        """The resolved config as plain picklable data (enums as strings), with what the
        executor decided on this machine pinned (``ExecutorStage.decided``: e.g. ``graph_form``
        ``auto`` -> ``paged``), so every process of a server builds the same engine layout."""
        plain = plain_dict(self.config)
        if isinstance(plain.get("executor"), dict):
            plain["executor"].update(self.executor.decided())
        return plain

    # ------------------------------------------------------------------ request path

    def stage_context(self, tokenizer: Any = None) -> StageContext:
        """What stages get at setup; loads config.json and (unless given) the tokenizer."""
        return StageContext(
            model_name=self.model_name,
            model_path=self.model_path,
            model_config=self.model_arch,
            tokenizer=tokenizer if tokenizer is not None else self.tokenizer,
            max_model_len=self.max_model_len,
        )

    @property
    def engine_slots(self) -> dict[str, EngineStage]:
        """The engine-side stages of the slots present in the config, in slot order."""
        return {name: getattr(self, name) for name in ENGINE_SLOTS if name in self.present_slots}

    def setup_stages(self, context: StageContext | None = None) -> StageContext:
        """Call ``setup`` on every request and response stage once (thread-safe); returns the
        context."""
        with self._lock:
            if self._context is None:
                ctx = context or self.stage_context()
                for stage in self.request_stages:
                    stage.setup(ctx)
                for response_stage in self.response_stages:
                    response_stage.setup(ctx)
                self.reasoning_parser.setup(ctx)
                self.tool_parser.setup(ctx)
                self._context = ctx
            return self._context

    def process(self, request: StageRequest) -> StageRequest:
        """Run ``request`` through the request stages; ``StageError`` propagates (HTTP 4xx)."""
        if self._context is None:
            self.setup_stages()
        for stage in self.request_stages:
            request = stage.process(request)
        return request

    # ------------------------------------------------------------------ engine

    def kv_layout(self) -> KVLayout:
        """The engine's physical layout, computed once from the stages' settings."""
        from inferflow.scheduling.layout import KVLayout

        context = self.served_context  # (a KV budget too small is its own ConfigError)
        try:
            return KVLayout.plan(
                max_slots=self.max_slots,
                max_model_len=context.served,
                block_size=self.cache.block_size,
                num_blocks=context.num_blocks or self.cache.num_blocks,
                paged=self.executor.pages_kv,
                sliding_window=self.kv_window,
            )
        except ValueError as exc:
            raise ConfigError(f"engine layout: {exc}") from None

    def check_engine_settings(self) -> KVLayout:
        """Refuse, in one line naming the keys, every engine setting the worker would refuse:
        the layout, the scheduler's budgets against it, the executor's settings. Loads nothing;
        returns the layout ``create_engine`` builds on. (The
        checkpoint's files: ``check_checkpoint``, which a single-model server runs at start; a
        model repository reports a model that cannot load and serves the others.)
        """
        from inferflow.scheduling.config import SchedulerConfigError, check_budgets

        layout = self.kv_layout()
        try:
            check_budgets(self.batching, layout)
        except SchedulerConfigError as exc:
            raise ConfigError(
                f"batching.{exc}{_ADVICE.get(exc.field, '')}", f"batching.{exc.field}"
            ) from None
        self._check_lora_settings()
        if self.speculative.enabled and not self.executor.verifies_drafts:
            raise ConfigError(
                f"speculative: the {self.executor.backend or type(self.executor).__name__} "
                "executor does not verify drafts; use speculative=none (or executor=onnxruntime"
                " / executor=torch)", "speculative"
            )
        try:
            self.executor.check(layout)
        except ValueError as exc:
            message = str(exc).removeprefix("executor.")
            raise ConfigError(f"executor.{message}", "executor") from None
        return layout

    def _check_lora_settings(self) -> None:
        """With LoRA on: an executor that serves adapters, and adapter names no model has (a
        model repository's entries' adapters too)."""
        from inferflow.graph.repository import repository_entries

        if self.lora.spec() is not None:
            if not self.executor.serves_lora:
                name = self.executor.backend or type(self.executor).__name__
                raise ConfigError(f"lora: executor={name} does not serve LoRA adapters (use "
                                  "executor=onnxruntime or executor=torch, or ~lora)", "lora")
            self._check_adapter_names(self.lora.adapters, "lora")
        if self.config.get("models"):
            for entry in repository_entries(self.config):
                node = entry.config.get("lora") or {}
                if node.get("adapters"):
                    self._check_adapter_names(node["adapters"], f"models.{entry.key}.lora")

    def _check_adapter_names(self, adapters: Mapping[str, Any], where: str) -> None:
        clash = sorted(set(map(str, adapters)) & self.served_model_names())
        if clash:
            key = f"{where}.adapters.{clash[0]}"
            raise ConfigError(f"{key}: the name of a served model; an adapter's name must "
                              "differ from every model's", key)

    def create_engine(self, wrap_executor: ExecutorWrapper | None = None) -> LLMEngine:
        """Load the checkpoint and assemble the engine from the engine-side stages: the executor
        builds (or loads the cached) compiled model, the batching stage is the scheduler's
        policy, the cache stage its prefix cache. Expensive; once per graph."""
        from inferflow.engine.llm_engine import LLMEngine
        from inferflow.models.checkpoint import load_checkpoint
        from inferflow.scheduling.scheduler import Scheduler

        layout = self.check_engine_settings()
        checkpoint = load_checkpoint(self.model_path, self.model.generation_config)
        self.executor.limit_steps(self.batching.max_num_batched_tokens)
        lora = self.lora_registry()
        if lora is not None:
            self.executor.enable_lora(lora.spec)
        self.executor.load(checkpoint, layout)
        scheduler = Scheduler(self.batching, layout, kv=self.cache.create(layout),
                              proposer=self.speculative.proposer(),
                              max_loras=lora.spec.max_loras if lora is not None else None)
        return LLMEngine(
            checkpoint, self.executor, scheduler, self.detokenizer, wrap_executor, self.guided,
            lora=lora, reserved_names=self.served_model_names() if lora is not None else (),
        )

    def lora_registry(self) -> LoraRegistry | None:
        """The adapters of ``lora.adapters``, read and checked (None: LoRA off). A bad adapter
        is a ConfigError naming ``lora.adapters.NAME``."""
        spec = self.lora.spec()
        if spec is None:
            return None
        from inferflow.lora.adapter import LoraError
        from inferflow.lora.registry import LoraRegistry

        registry = LoraRegistry(spec, self.model_arch, self.lora.cpu_loras)
        for name, path in self.lora.adapters.items():
            try:
                registry.add(name, Path(path).expanduser(), field_name=f"lora.adapters.{name}")
            except LoraError as exc:
                raise ConfigError(str(exc), exc.field) from None
        return registry


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """A CheckpointError (one line naming the file and the problem) as a ConfigError of
    ``model.path``: what the user fixes is the checkpoint, or which one is served."""
    from inferflow.models.errors import CheckpointError

    try:
        yield
    except CheckpointError as exc:
        raise ConfigError(str(exc), "model.path") from None


def _server_schema(node: Any) -> type:
    """``server=ray`` (``runtime: ray``) has its own schema; every other server is LitServe's."""
    runtime = node.get("runtime") if node is not None else None
    return RayServerConfig if str(runtime) == "ray" else ServerConfig


def build_graph(cfg: DictConfig | Mapping[str, Any]) -> ServingGraph:
    """Instantiate the serving graph described by ``cfg`` (a composed config or its plain dict).

    Raises :class:`~inferflow.config.ConfigError` (one line naming the key) for anything the
    user must fix: bad values, unknown keys, disallowed ``_target_``, a missing checkpoint.
    """
    source = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    try:
        resolved = OmegaConf.create(
            OmegaConf.to_container(source, resolve=True, throw_on_missing=True)
        )
    except OmegaConfBaseException as exc:
        raise describe_omegaconf_error(exc) from None
    assert isinstance(resolved, DictConfig)
    return _build(resolved)


def build_entry_graph(entry: RepositoryEntry) -> ServingGraph:
    """A model repository entry's ``ServingGraph``; its config errors name the entry's key."""
    try:
        return build_graph(entry.config)
    except ConfigError as exc:
        if not entry.key:
            raise
        key = f"models.{entry.key}.{exc.key}" if exc.key else f"models.{entry.key}"
        raise ConfigError(f"models.{entry.key}: {exc}", key) from None


def _build(cfg: DictConfig) -> ServingGraph:
    model: ModelConfig = typed_config(ModelConfig, cfg.get("model"), "model")
    model_path, model_name = resolve_model(model)
    cfg.model.path, cfg.model.name = str(model_path), model_name
    prefixes = allowed_prefixes(cfg)
    pipeline = [str(s) for s in cfg.get("pipeline") or SLOTS]
    for slot in pipeline:
        if slot not in SLOTS:
            raise ConfigError(
                f"pipeline: unknown slot {slot!r}; slots: {', '.join(SLOTS)}", "pipeline"
            )
    if cfg.get("executor") is None:
        raise ConfigError(
            "executor: required (executor=onnxruntime or executor=tensorrt)", "executor"
        )
    extra = {str(k): v for k, v in (cfg.get("stages") or {}).items()}
    built: dict[str, Any] = {}
    for name in pipeline:
        if cfg.get(name) is not None:
            kind = RequestStage if name in REQUEST_SLOTS else (
                RESPONSE_SLOT_KINDS.get(name) or ENGINE_STAGE_KINDS[name]
            )
            built[name] = instantiate_stage(cfg[name], name, kind, prefixes)
    late = {"speculative": SpeculativeStage, "lora": LoraStage, **RESPONSE_SLOT_KINDS}
    for name, kind in late.items():
        if name not in pipeline and cfg.get(name) is not None:
            # (a pipeline list written before the slot existed: the slot still applies)
            built[name] = instantiate_stage(cfg[name], name, kind, prefixes)
    for name, node in extra.items():
        built[name] = instantiate_stage(
            node, f"stages.{name}", (RequestStage, ResponseStage), prefixes
        )
    request_stages, response_stages = place_stages(splice_order(pipeline, extra), built)

    def engine_stage(name: str, default: type[EngineStage]) -> Any:
        return built[name] if name in built else default()

    return ServingGraph(
        model_name=model_name,
        model_path=model_path,
        model=dataclasses.replace(model, path=str(model_path), name=model_name),
        request_stages=request_stages,
        response_stages=response_stages,
        batching=engine_stage("batching", NoBatching),
        cache=engine_stage("cache", NoPrefixCache),
        executor=built["executor"],
        detokenizer=engine_stage("detokenizer", StreamingDetokenizer),
        guided=engine_stage("guided", NoGuidedDecoding),
        speculative=engine_stage("speculative", NoSpeculation),
        lora=engine_stage("lora", LoraStage),
        reasoning_parser=built.get("reasoning_parser") or AutoReasoningParser(),
        tool_parser=built.get("tool_parser") or AutoToolParser(),
        present_slots=tuple(n for n in ENGINE_SLOTS if n in built),
        server=typed_config(_server_schema(cfg.get("server")), cfg.get("server"), "server"),
        tracing=typed_config(TracingConfig, cfg.get("tracing"), "tracing"),
        config=cfg,
    )
