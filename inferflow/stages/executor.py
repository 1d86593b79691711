"""The ``executor`` slot: what runs the model, one call per engine step.

``executor=onnxruntime`` (CPU, the default), ``executor=tensorrt`` (NVIDIA GPU, optional extra) or
``executor=torch`` (CPU or CUDA, paged KV, optional extra ``inferflow[torch]``; its stage is in
``stages/torch_executor.py``);
a plugin adds its own with ``executor=NAME`` (a YAML whose ``_target_`` is an
:class:`ExecutorStage` subclass, e.g. one that wraps a built-in executor).
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from inferflow.config.tunable import tunable
from inferflow.runtimes.config import GraphForm, OrtSettings, Precision
from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from inferflow.lora.adapter import LoraSpec
    from inferflow.lora.slots import LoraSlots
    from inferflow.models.checkpoint import Checkpoint
    from inferflow.models.config import ModelArch
    from inferflow.runtimes.plan_runner import PlanRunner, Runner
    from inferflow.scheduling.kv_budget import KVBudget
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput


@dataclass
class ExecutorStage(EngineStage):
    """Contract of the ``executor`` slot.

    - ``max_slots``: sequences resident at once (rows of the KV buffers); ``None`` = the batching
      stage's ``max_num_seqs``. It goes into the engine's frozen ``KVLayout``.
    - :meth:`load` (once, in the engine worker, before any step): build or load the compiled
      model for ``checkpoint`` and allocate KV for ``layout`` (slots of ``layout.max_model_len``
      positions, a pool of ``layout.num_blocks`` x ``layout.block_size``).
    - :meth:`execute` runs one :class:`~inferflow.scheduling.plan.SchedulerOutput`: its
      ``kv_loads`` (pool -> slot), one forward pass over its chunks, sampling of the chunks with
      ``sample=True``, then its ``kv_saves`` (slot -> pool). It returns one sampled token per
      sampled chunk, and drops per-request state (e.g. seeded RNGs) of
      ``plan.finished_request_ids``; a plan may hold nothing else (no chunks).
    - :meth:`limit_steps` is called before :meth:`load` with the scheduler's token budget per
      step (no plan carries more tokens), for executors whose compiled model has static shape
      limits (TensorRT's optimization profiles).
    - ``backend`` and :attr:`runtime_version` name what really runs (``/version``, traces).
    - ``pages_kv``: the executor keeps KV in the block pool itself (``KVLayout.paged``): it
      allocates ``layout.num_blocks`` blocks and no slots, and reads each chunk's KV through its
      ``block_table``; plans then carry no ``kv_loads``/``kv_saves``.
    - ``verifies_drafts``: :meth:`execute` handles chunks with ``draft_token_ids`` (speculative
      decoding): logits for each draft position, verified, accepted ones in
      ``ExecutorOutput.accepted_drafts``. An executor without it (the default for plugins)
      refuses ``speculative=...``; the built-in ones run plans through ``PlanRunner``, which
      verifies.
    - ``returns_prompt_logprobs``: :meth:`execute` returns the prompt logprobs of chunks with
      ``prompt_logprob_ids`` (logits for every position of such a prefill chunk,
      ``ExecutorOutput.prompt_logprobs``). Without it (plugins by default, TensorRT) the engine
      refuses requests with ``SamplingParams.prompt_logprobs``.
    - The stage owns that ``PlanRunner``: a stage that implements :meth:`create_runner` (a
      :class:`~inferflow.runtimes.plan_runner.Runner` for the checkpoint and layout) gets
      :meth:`load`, :meth:`execute` and :attr:`runner` from here; a plugin may instead override
      :meth:`load` and :meth:`execute` themselves.
    - :meth:`estimate_bytes`: the host memory a loaded engine holds (a model repository's
      admission check).
    - :meth:`enable_lora` (multi-LoRA, ``inferflow.lora``) is called before :meth:`load` when the
      ``lora`` slot is on, with the engine's :class:`~inferflow.lora.LoraSpec`: the runner is
      built with LoRA inputs (every target projection gains ``((x @ A_all) * mask) @ B_all``)
      and implements :class:`~inferflow.lora.slots.LoraRunner`. ``serves_lora`` says an
      executor can (the built-in ONNX Runtime and torch ones); others refuse in one line.
    - ``logits_processors``: extra :class:`~inferflow.sampling.logits_processors.LogitsProcessor`
      objects (``_target_`` nodes, allowlisted like every target) the sampler applies after the
      built-in penalties and ``logit_bias``, to the rows they say they apply to (a plugin's
      hook: ``executor.logits_processors='[{_target_: my_plugin.NoDigits}]'``). A plugin
      executor that overrides :meth:`load` passes them to its own ``Sampler``.
    """

    kind: ClassVar[str] = "executor"
    pages_kv: ClassVar[bool] = False
    verifies_drafts: ClassVar[bool] = False
    returns_prompt_logprobs: ClassVar[bool] = False
    serves_lora: ClassVar[bool] = False
    backend: ClassVar[str] = ""
    runtime_package: ClassVar[str] = ""  # distribution whose version runtime_version reports
    max_slots: int | None = None
    logits_processors: list[Any] = field(default_factory=list)
    step_token_budget: int = field(default=0, init=False, repr=False)  # from limit_steps; 0 = unset
    # the LoraSpec from enable_lora (None: LoRA off; Any: the schema resolves fields' types)
    lora_spec: Any = field(default=None, init=False, repr=False)
    # the PlanRunner once loaded (Any: the schema of a stage resolves its fields' types)
    _plan: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_slots is not None and self.max_slots < 1:
            raise ValueError(f"max_slots: must be >= 1, got {self.max_slots}")
        from inferflow.sampling.logits_processors import LogitsProcessor

        for i, processor in enumerate(self.logits_processors):
            if not isinstance(processor, LogitsProcessor):
                raise ValueError(f"logits_processors: entry {i} must be a LogitsProcessor (a "
                                 f"_target_ with applies() and apply()), got {processor!r}")

    def check(self, layout: KVLayout) -> None:
        """Raise ``ValueError`` ("field: message") for settings ``load`` would refuse, without
        loading anything (``task=check`` and server start call it in the main process)."""

    def decided(self) -> dict[str, Any]:
        """Settings whose ``auto`` this executor decided from the machine, as config values
        (``ServingGraph.to_container`` pins them for the server's other processes)."""
        return {}

    def layout_note(self) -> str | None:
        """One line when an ``auto`` setting fell back to something slower on this machine
        (logged once at start, a ``note:`` of ``task=check``; None: nothing to say)."""
        return None

    def limit_steps(self, max_num_batched_tokens: int) -> None:
        """The scheduler's token budget per step (``batching.max_num_batched_tokens``)."""
        self.step_token_budget = max_num_batched_tokens

    def enable_lora(self, spec: LoraSpec) -> None:
        """Build the engine with LoRA inputs of shape ``spec`` (called before :meth:`load`);
        ``ValueError`` where this executor does not serve adapters."""
        if not self.serves_lora:
            name = self.backend or type(self).__name__
            raise ValueError(f"lora: executor={name} does not serve LoRA adapters")
        self.lora_spec = spec

    def use_lora_slots(self, slots: LoraSlots,
                       running: Callable[[], Collection[str]] | None = None) -> None:
        """The engine's adapter slots over this executor's loaded runner (``LLMEngine`` calls it
        once, after :meth:`load`): every plan's adapters are made resident through them, never
        in the slot of an adapter of ``running()`` (the running requests' adapters)."""
        plan = self._loaded()
        plan.lora_slots, plan.lora_running = slots, running

    def _runner_lora(self) -> dict[str, Any]:
        """The runner's ``lora=`` keyword when LoRA is on (none otherwise)."""
        return {} if self.lora_spec is None else {"lora": self.lora_spec}

    def kv_budget(self, arch: ModelArch, model_bytes: int) -> KVBudget | None:
        """The KV memory this executor may reserve (None: unbounded); the graph caps the served
        ``max_model_len`` so the slots and the pool fit in it (``scheduling/kv_budget.py``)."""
        return None

    def create_runner(self, checkpoint: Checkpoint, layout: KVLayout) -> Runner:
        """The model runner :meth:`load` wraps in a ``PlanRunner`` (built-in executors)."""
        raise NotImplementedError(f"{type(self).__name__}: implement create_runner, or load "
                                  "and execute")

    def load(self, checkpoint: Checkpoint, layout: KVLayout) -> None:
        """Build or load the compiled model and allocate its KV (expensive, once)."""
        from inferflow.runtimes.plan_runner import PlanRunner
        from inferflow.sampling.sampler import Sampler

        runner = self.create_runner(checkpoint, layout)
        self._plan = PlanRunner(runner, Sampler(checkpoint.eos_token_ids, self.logits_processors))

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        """Run one step's plan; see the class docstring for the order of its parts."""
        return self._loaded().execute(plan)

    @property
    def runner(self) -> Runner:
        """The loaded model runner (``OnnxRuntimeRunner``, ``TensorRTRunner``, ``TorchRunner``)."""
        return self._loaded().runner

    @property
    def loaded(self) -> bool:
        return self._plan is not None

    def _loaded(self) -> PlanRunner:
        from inferflow.runtimes.plan_runner import PlanRunner

        if not isinstance(self._plan, PlanRunner):
            raise RuntimeError(f"executor={self.backend}: load() was not called")
        return self._plan

    def weight_scale(self) -> float:
        """Host bytes of the loaded weights per byte of fp32 weights (0: they live on a GPU)."""
        return 1.0

    def estimate_bytes(self, layout: KVLayout, fp32_weight_bytes: float,
                       budget: KVBudget | None) -> int:
        """Host memory this executor holds once loaded: the weights (``weight_scale``) and the
        KV ``layout`` reserves (the pool, and the slots unless paged) at the budget's bytes per
        token (none on a GPU, or without a budget)."""
        scale = self.weight_scale()
        tokens = layout.num_blocks * layout.block_size
        if not layout.paged:
            tokens += layout.max_slots * layout.max_model_len
        kv = 0 if scale == 0 or budget is None else tokens * budget.bytes_per_token
        return int(fp32_weight_bytes * scale) + kv

    @property
    @abstractmethod
    def runtime_version(self) -> str:
        """Version of the runtime that executes the model (e.g. ONNX Runtime's)."""

    def package_version(self) -> str | None:
        """``runtime_package``'s installed version, read without importing it (API processes
        never import the runtime)."""
        import importlib.metadata

        try:
            return (
                importlib.metadata.version(self.runtime_package) if self.runtime_package else None
            )
        except importlib.metadata.PackageNotFoundError:
            return None

    def settings(self) -> dict[str, Any]:
        """The values in effect; a logits processor as its class's import path."""
        return {**super().settings(), "logits_processors": [
            f"{type(p).__module__}.{type(p).__qualname__}" for p in self.logits_processors]}

    def describe(self) -> dict[str, Any]:
        """What runs, for ``/version`` and the trace resource."""
        return {"backend": self.backend, "runtime_version": self.runtime_version}

    def stats(self) -> dict[str, float]:
        """Counters shown under ``engine.executor`` in ``/admin/stats`` (default: none)."""
        return {}


# graph_form=auto without the op: what is lost and how to get it
NO_PAGED_OP = (
    "paged KV off: the paged-attention op for ONNX Runtime is not available ({reason}); serving "
    "on slot KV buffers (max_num_seqs x max_model_len reserved, prefix hits copied, no shared "
    "blocks). To get it: a C++ compiler and ONNX Runtime's C headers (Debian's "
    "libonnxruntime-dev, or `python -m inferflow.runtimes.ort_ops fetch-headers`); "
    "executor.graph_form=gqa says this choice explicitly")


# host bytes of the weights per byte of fp32 ones (int8/int4 keep scales and fp32 embeddings)
_PRECISION_SCALE = {Precision.fp32: 1.0, Precision.fp16: 0.5, Precision.bf16: 0.5,
                    Precision.int8: 0.3, Precision.int4: 0.2}


@dataclass
class OnnxRuntimeExecutor(ExecutorStage):
    """ONNX Runtime on CPU. ``intra_op_threads=0`` lets ONNX Runtime pick (one per core);
    ``cache_dir`` (compiled engines) defaults to ``$INFERFLOW_ENGINE_DIR`` or
    ``$INFERFLOW_HOME/compiled_engines``."""

    backend: ClassVar[str] = "onnxruntime"
    runtime_package: ClassVar[str] = "onnxruntime"
    verifies_drafts: ClassVar[bool] = True  # PlanRunner
    returns_prompt_logprobs: ClassVar[bool] = True  # PlanRunner; the graph returns any rows' logits
    serves_lora: ClassVar[bool] = True  # both graph forms
    # the precisions this runtime runs, and why the others are refused (one line each)
    precisions: ClassVar[tuple[Precision, ...]] = (Precision.fp32, Precision.fp16, Precision.int8,
                                                   Precision.int4)
    refused_precisions: ClassVar[dict[Precision, str]] = {
        Precision.bf16: "ONNX Runtime's CPU kernels have no bfloat16 MatMul; bf16 is for "
                        "executor=tensorrt (or executor=torch executor.dtype=bfloat16)",
    }
    precision: Precision = tunable(Precision.fp32, choices=("fp32", "int8", "int4"),
                                   note="weight precision: int8/int4 trade accuracy for speed")
    # paged where the op builds, else gqa (slots)
    graph_form: GraphForm = tunable(GraphForm.auto, choices=("paged", "gqa"),
                                    note="KV layout: a paged pool or one buffer per slot")
    intra_op_threads: int = tunable(0, low=0, high=None,
                                    note="ONNX Runtime's threads per step (0: one per core)")
    inter_op_threads: int = 1
    allow_spinning: bool = True  # within a call only: the spin stops when it returns
    cache_dir: str | None = None
    quant_block_size: int = 32
    quant_accuracy_level: int = 4  # int8/int4 MatMulNBits: 0 = float activations, 4 = int8 (faster)
    kv_cache_memory: str = "auto"  # KV budget: bytes, "4GiB", "512MiB", or auto

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ValueError(
                "intra_op_threads / inter_op_threads: must be >= 0 (0 = runtime default)"
            )
        if self.quant_block_size < 1:
            raise ValueError(f"quant_block_size: must be >= 1, got {self.quant_block_size}")
        precision = Precision(self.precision)
        if precision not in self.precisions:
            offered = ", ".join(p.value for p in self.precisions)
            why = self.refused_precisions.get(precision, "not supported")
            raise ValueError(f"precision: {precision.value} is not offered by executor="
                             f"{self.backend}: {why} (offered: {offered})")
        from inferflow.scheduling.kv_budget import parse_memory

        parse_memory(self.kv_cache_memory, "kv_cache_memory")  # a bad size fails at config time
        if self.quant_accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"quant_accuracy_level: must be 0..4, got {self.quant_accuracy_level}")

    def kv_budget(self, arch: ModelArch, model_bytes: int) -> KVBudget | None:
        from inferflow.scheduling.kv_budget import KVBudget, kv_bytes_per_token

        half = (Precision.fp16, Precision.bf16)
        itemsize = 2 if Precision(self.precision) in half else 4  # activations' dtype
        return KVBudget.resolve(
            self.kv_cache_memory, kv_bytes_per_token(arch, itemsize), model_bytes,
            paged=self.pages_kv,
        )

    def decided(self) -> dict[str, Any]:
        return {"graph_form": self.resolved_graph_form().value}

    @property
    def pages_kv(self) -> bool:  # type: ignore[override]
        return self.resolved_graph_form() is GraphForm.paged

    def resolved_graph_form(self) -> GraphForm:
        """``graph_form``, with ``auto`` decided: ``paged`` where the paged-attention op builds
        on this machine (once per process; ``runtimes/ort_ops``), else ``gqa`` (``layout_note``
        says what is lost and how to get the op)."""
        form = GraphForm(self.graph_form)
        if form is not GraphForm.auto:
            return form
        from inferflow.runtimes.ort_ops.build import op_status

        return GraphForm.paged if op_status()[0] else GraphForm.gqa

    def layout_note(self) -> str | None:
        if GraphForm(self.graph_form) is not GraphForm.auto:
            return None
        from inferflow.runtimes.ort_ops.build import op_status

        available, reason = op_status()
        return None if available else NO_PAGED_OP.format(reason=reason)

    def check(self, layout: KVLayout) -> None:
        super().check(layout)
        if GraphForm(self.graph_form) is GraphForm.paged:
            from inferflow.runtimes.ort_ops.build import op_status

            available, reason = op_status()
            if not available:
                raise ValueError(f"graph_form: paged needs the paged-attention op, which is not "
                                 f"available here: {reason}")

    def settings_for_runner(self) -> OrtSettings:
        """The runner's settings: these fields (the sizes are the layout's)."""
        return OrtSettings(
            precision=Precision(self.precision).value,
            graph_form=self.resolved_graph_form().value,
            intra_op_threads=self.intra_op_threads,
            inter_op_threads=self.inter_op_threads,
            allow_spinning=self.allow_spinning,
            cache_dir=self.cache_dir,
            quant_block_size=self.quant_block_size,
            quant_accuracy_level=self.quant_accuracy_level,
            max_num_batched_tokens=self.step_token_budget,
        )

    def create_runner(self, checkpoint: Checkpoint, layout: KVLayout) -> Runner:
        settings = self.settings_for_runner()
        if GraphForm(self.graph_form) is GraphForm.auto and not layout.paged:
            # a caller that planned slots (an offline engine built by hand) gets slots
            settings = dataclasses.replace(settings, graph_form=GraphForm.gqa.value)
        if settings.graph_form == GraphForm.paged.value:
            from inferflow.runtimes.onnxruntime_paged import PagedOnnxRuntimeRunner

            return PagedOnnxRuntimeRunner(checkpoint, settings, layout, **self._runner_lora())
        from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner

        return OnnxRuntimeRunner(checkpoint, settings, layout, **self._runner_lora())

    def weight_scale(self) -> float:
        return _PRECISION_SCALE[Precision(self.precision)]

    @property
    def runtime_version(self) -> str:
        import onnxruntime

        return str(onnxruntime.__version__)

    def stats(self) -> dict[str, float]:
        """``kv_resident``: 1 once the runner's KV memory is resident (populated in the
        background after load, ``runtimes/kv_memory.py``), 0 before."""
        resident = getattr(self.runner, "kv_resident", None) if self.loaded else None
        if resident is None:  # a runner without background population (TensorRT)
            return {}
        return {"kv_resident": float(resident)}

    def describe(self) -> dict[str, Any]:
        if not self.loaded:
            return super().describe()
        entry = getattr(self.runner, "cache_entry", None)
        built = getattr(self.runner, "settings", None)  # the OrtSettings it was built with
        settings = dataclasses.asdict(built) if built is not None else None
        if settings and settings.get("cache_dir"):
            settings["cache_dir"] = "(set)"  # where engines are cached is not for clients
        return {
            **super().describe(),
            "compiled_engine": str(entry.model_path.parent) if entry is not None else None,
            "runtime_config": settings,
        }


@dataclass
class TensorRTExecutor(OnnxRuntimeExecutor):
    """TensorRT on an NVIDIA GPU (``pip install inferflow[tensorrt]``). TensorRT's ONNX parser
    needs the standard-op graph, so ``graph_form`` must be ``canonical``."""

    backend: ClassVar[str] = "tensorrt"
    runtime_package: ClassVar[str] = "tensorrt"
    # its optimization profiles return one logits row per sequence (logits_index <= max_slots)
    verifies_drafts: ClassVar[bool] = False
    returns_prompt_logprobs: ClassVar[bool] = False
    serves_lora: ClassVar[bool] = False
    # TensorRT's quantization: weight-only for INT4 only; INT8 and FP8 quantize activations
    # and weights together (calibrated activation scales), a form the graph does not emit
    precisions: ClassVar[tuple[Precision, ...]] = (Precision.fp32, Precision.fp16, Precision.bf16,
                                                   Precision.int4)
    refused_precisions: ClassVar[dict[Precision, str]] = {
        Precision.int8: "TensorRT runs weight-only quantization for int4 only (its int8 "
                        "quantizes activations too); use int4, fp16 or bf16",
    }
    precision: Precision = Precision.fp16
    graph_form: GraphForm = GraphForm.canonical
    device_id: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if GraphForm(self.graph_form) is not GraphForm.canonical:
            raise ValueError(
                "graph_form: tensorrt needs 'canonical' (its parser ignores op domains)"
            )
        if self.device_id < 0:
            raise ValueError(f"device_id: must be >= 0, got {self.device_id}")

    def settings_for_runner(self) -> OrtSettings:
        return dataclasses.replace(super().settings_for_runner(), device_id=self.device_id)

    def create_runner(self, checkpoint: Checkpoint, layout: KVLayout) -> Runner:
        from inferflow.runtimes.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(checkpoint, self.settings_for_runner(), layout)

    def check(self, layout: KVLayout) -> None:
        super().check(layout)
        from inferflow.runtimes.tensorrt_runner import INSTALL_HINT, tensorrt_available

        if not tensorrt_available():
            raise ValueError(f"backend: {INSTALL_HINT}")

    @property
    def runtime_version(self) -> str:
        import tensorrt  # only here: the optional extra

        return str(tensorrt.__version__)
