"""TensorRT engine (NVIDIA GPUs), built from the canonical standard-op ONNX graph.

TensorRT's ONNX parser ignores op domains, so it always gets the ``canonical`` form
(RMSNormalization, RotaryEmbedding, TensorScatter, Attention; weight-only int8/int4 through
DequantizeLinear), never the CPU form. The families' traits are standard attributes there
(``models/graph_attention.py``): Attention's ``scale`` and ``softcap`` (Gemma 2; whether
TensorRT's parser takes ``softcap`` has not been checked on a GPU), RotaryEmbedding's
``rotary_embedding_dim`` (partial rotary, which TensorRT's rotary layer supports), one bool mask
per window; the KV buffers hold the whole context on windowed layers too.

``tensorrt`` and ``cuda-python`` are imported lazily: this module imports, and its pure parts
(profiles, buffer plans, step arrays) are unit-tested, on a machine without a GPU. Install the
GPU extra with ``pip install inferflow[tensorrt]``.

Shapes: two optimization profiles (``optimization_profiles``), decode-only steps and steps with
prefill chunks, sized from the scheduler's limits: at most ``max_slots`` rows (``max_num_seqs``),
``max_num_batched_tokens`` tokens per step, a chunk no longer than either of those or the
context. ``logits_index`` is never empty: a step in which no row samples (e.g. a chunked prefill
that does not finish its prompt) binds one dummy row and returns no logits. Every
``set_input_shape``/``set_tensor_address``/``execute_async_v3`` result is checked: a refused
shape is an error naming the tensor, its shape and the profile's limits.

Lifetimes: one ``trt.Logger`` per process (TensorRT keeps a single logger pointer), shared by
the builder and every runtime; a :class:`TensorRTRuntime` holds its ``trt.Runtime`` beside the
engine it deserialized and the context made from it, and ``close()`` releases them in the
order TensorRT requires (context, engine, runtime), then the device buffers and the stream.

The plan cache: ``engine.plan`` is built in the cache entry's build folder, after the canonical
graph is saved there and checked against TensorRT's documented constraints
(``tensorrt_graph.py``), written atomically, and listed in the entry's manifest with its digest
before the entry is published (``engine_cache.get_or_build(finish=...)``); a truncated or
altered plan fails the manifest check and is rebuilt. A plan that TensorRT cannot deserialize
(``deserialize_cuda_engine`` returns None) is a :class:`PlanError`: the runner drops the entry
and builds once more, and a second failure is the error.

Precisions (``TensorRTExecutor.precisions``): fp32, fp16, bf16, and int4 weight-only
(block-quantized ``DequantizeLinear`` weights, float32 activations). int8 weight-only is
refused (TensorRT quantizes int8 weights only with int8 activations), and there is no FP8 (it
too needs calibrated activation scales, which the weight-only graph does not carry).

Memory: per layer one device buffer each for K and V of shape (max_slots, Hkv, C_alloc, D);
``past_*`` and ``present_*`` are bound to the same address (TensorScatter lowers to an in-place
KV-cache update). Each call runs over slots [0, B): idle slots write their padded garbage at their
current length, which must stay inside the buffer, hence ``C_alloc = max_model_len + max_chunk``
(headroom for one padded chunk) while the scheduler only ever uses ``max_model_len`` positions.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from inferflow.models.config import ModelArch
from inferflow.runtimes.step_inputs import EngineRow, StepArrays, build_step_arrays

if TYPE_CHECKING:
    from inferflow.models.checkpoint import Checkpoint
    from inferflow.runtimes.config import OrtSettings
    from inferflow.runtimes.engine_cache import CacheEntry
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.plan import KVBlockCopy

log = logging.getLogger(__name__)

INSTALL_HINT = "TensorRT is not installed: pip install 'inferflow[tensorrt]' (needs an NVIDIA GPU)"
PLAN_FILE = "engine.plan"
_LOGGER: list[Any] = []  # [tensorrt module, its one trt.Logger] once made


class PlanError(RuntimeError):
    """TensorRT could not load a plan (``deserialize_cuda_engine`` or the context failed)."""


def trt_logger(trt: Any) -> Any:
    """The process's one ``trt.Logger`` (TensorRT keeps one logger pointer for every builder
    and runtime; it must outlive them all, so it is never released)."""
    if not _LOGGER or _LOGGER[0] is not trt:
        _LOGGER[:] = [trt, trt.Logger(trt.Logger.WARNING)]
    return _LOGGER[1]


def tensorrt_available() -> bool:
    """True when the tensorrt and cuda-python packages can be imported (no import happens)."""
    return importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("cuda") is not None


def import_tensorrt() -> Any:
    if importlib.util.find_spec("tensorrt") is None:
        raise RuntimeError(INSTALL_HINT)
    return importlib.import_module("tensorrt")


def import_cudart() -> Any:
    """cuda-python's runtime module (new layout ``cuda.bindings.runtime``, old ``cuda.cudart``)."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError(INSTALL_HINT)


@dataclass(frozen=True)
class Profile:
    """One TensorRT optimization profile: input name -> (min, opt, max) shapes."""

    name: str
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def step_limits(capacity: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(longest chunk, most tokens) one step can carry: the scheduler never puts more than its
    token budget in a step, nor a chunk past the context. An unknown budget (0) assumes chunks
    of up to 2048 tokens and returns 0 tokens (``optimization_profiles``' default)."""
    if not max_num_batched_tokens:
        return max(1, min(capacity, 2048)), 0
    return max(1, min(capacity, max_num_batched_tokens)), max_num_batched_tokens


def optimization_profiles(
    cfg: ModelArch, max_slots: int, alloc_capacity: int, max_chunk: int, max_tokens: int = 0
) -> list[Profile]:
    """Profile 0 serves decode-only steps (S == 1), profile 1 steps with prefill chunks.

    ``max_chunk``: the longest chunk (padded row length); ``max_tokens``: most tokens in one step
    (default: one full chunk plus a decode token for every other slot)."""
    kv = (cfg.num_kv_heads, alloc_capacity, cfg.head_dim)
    max_tokens = max_tokens or max_chunk + max_slots

    def profile(name: str, s_max: int, n_max: int) -> Profile:
        s_opt, n_opt = max(1, s_max // 2), max(1, n_max // 2)
        shapes = {
            "input_ids": ((1,), (n_opt,), (n_max,)),
            "unpad_index": ((1,), (n_opt,), (n_max,)),
            "logits_index": ((1,), (max_slots,), (max_slots,)),
            "pad_index": ((1, 1), (max_slots, s_opt), (max_slots, s_max)),
            "position_ids": ((1, 1), (max_slots, s_opt), (max_slots, s_max)),
            "write_indices": ((1,), (max_slots,), (max_slots,)),
        }
        for i in range(cfg.num_layers):
            for kind in ("key", "value"):
                shapes[f"past_{kind}_{i}"] = ((1, *kv), (max_slots, *kv), (max_slots, *kv))
        return Profile(name, shapes)

    return [profile("decode", 1, max_slots), profile("prefill", max_chunk, max_tokens)]


def profile_index(arrays: StepArrays) -> int:
    return 0 if arrays.pad_index.shape[1] == 1 else 1


def step_feeds(arrays: StepArrays, slot_lengths: Sequence[int]) -> dict[str, np.ndarray]:
    """The non-KV inputs of one slot-range call. A step in which no row samples gets one dummy
    ``logits_index`` entry (the profiles' minimum is 1); the caller drops its logits."""
    logits_index = arrays.logits_index
    if len(logits_index) == 0:
        logits_index = np.zeros(1, dtype=np.asarray(arrays.logits_index).dtype)
    return {
        "input_ids": arrays.input_ids,
        "pad_index": arrays.pad_index,
        "unpad_index": arrays.unpad_index,
        "logits_index": logits_index,
        "position_ids": arrays.position_ids,
        "write_indices": idle_write_indices(arrays, slot_lengths),
    }


def set_shape(context: Any, name: str, shape: tuple[int, ...], profile: Profile) -> None:
    """``context.set_input_shape`` with its result checked: a refused shape names the limits."""
    if not context.set_input_shape(name, shape):
        lo, _, hi = profile.shapes.get(name, ((), (), ()))
        raise RuntimeError(
            f"TensorRT refused shape {tuple(shape)} for input {name!r} in profile "
            f"{profile.name!r} (min {lo}, max {hi}): the step exceeds the limits the engine was "
            "built for (batching.max_num_batched_tokens / max_num_seqs); rebuild it with larger ones"
        )


def idle_write_indices(arrays: StepArrays, slot_lengths: Sequence[int]) -> np.ndarray:
    """write_indices for a slot-range call: a row's start, an idle slot's current length.

    Idle slots get their padded garbage written past their valid tokens (never over them).
    """
    out = np.asarray(slot_lengths[: len(arrays.slots)], dtype=np.int64).copy()
    active = arrays.query_seqlens > 0
    out[active] = arrays.write_indices[active]
    return out


def build_serialized_engine(onnx_path: str, profiles: list[Profile], workspace_bytes: int = 4 << 30) -> bytes:
    """Parse the canonical ONNX file and build a strongly typed TensorRT plan."""
    trt = import_tensorrt()
    logger = trt_logger(trt)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    for p in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
    return bytes(plan)


def _check(result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


class TensorRTRuntime:
    """Executes steps on a deserialized plan with device KV buffers (GPU only)."""

    def __init__(self, plan: bytes, cfg: ModelArch, max_slots: int, alloc_capacity: int, dtype: np.dtype,
                 profiles: Sequence[Profile] = ()) -> None:
        trt, self.cudart = import_tensorrt(), import_cudart()
        # kept together: the engine must not outlive its runtime, nor the runtime its logger
        self.logger = trt_logger(trt)
        self.trt_runtime: Any = trt.Runtime(self.logger)
        self.engine: Any = self.trt_runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            self.trt_runtime = None
            raise PlanError(f"TensorRT could not deserialize the plan ({len(plan)} bytes): corrupt, "
                            "or built by another TensorRT version or GPU (see its log above)")
        self.context: Any = self.engine.create_execution_context()
        if self.context is None:
            self.engine = self.trt_runtime = None
            raise PlanError("TensorRT could not create an execution context for the plan "
                            "(out of device memory? see its log above)")
        self.stream = _check(self.cudart.cudaStreamCreate())
        self.cfg, self.max_slots, self.capacity = cfg, max_slots, alloc_capacity
        self.itemsize = np.dtype(dtype).itemsize
        self.slot_bytes = cfg.num_kv_heads * alloc_capacity * cfg.head_dim * self.itemsize
        self.kv = [[_check(self.cudart.cudaMalloc(self.slot_bytes * max_slots)) for _ in range(2)]
                   for _ in range(cfg.num_layers)]
        self.slot_lengths = [0] * max_slots
        self._scratch: dict[str, tuple[int, int]] = {}  # name -> (device ptr, bytes)
        # the shapes the plan was built for (named in errors); unknown -> no limits shown
        self.profiles = list(profiles) or [Profile("decode", {}), Profile("prefill", {})]

    def close(self) -> None:
        """Release in TensorRT's order: the context, the engine, the runtime (the logger is the
        process's); then the device buffers and the stream. Idempotent."""
        if self.trt_runtime is None:
            return
        self.context = None
        self.engine = None
        self.trt_runtime = None
        for ptr in [p for pair in self.kv for p in pair] + [p for p, _ in self._scratch.values()]:
            _check(self.cudart.cudaFree(ptr))
        self.kv, self._scratch = [], {}
        _check(self.cudart.cudaStreamDestroy(self.stream))

    def _upload(self, name: str, host: np.ndarray) -> int:
        ptr, size = self._scratch.get(name, (0, 0))
        if host.nbytes > size:
            if ptr:
                _check(self.cudart.cudaFree(ptr))
            ptr, size = _check(self.cudart.cudaMalloc(max(host.nbytes, 256))), max(host.nbytes, 256)
            self._scratch[name] = (ptr, size)
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        _check(self.cudart.cudaMemcpyAsync(ptr, host.ctypes.data, host.nbytes, kind, self.stream))
        return ptr

    def _bind(self, name: str, ptr: int) -> None:
        if not self.context.set_tensor_address(name, ptr):
            raise RuntimeError(f"TensorRT refused the device address of {name!r}")

    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        a = build_step_arrays(rows, slot_range=True)
        ctx = self.context
        index = profile_index(a)
        profile = self.profiles[index]
        if not ctx.set_optimization_profile_async(index, self.stream):
            raise RuntimeError(f"TensorRT cannot switch to optimization profile {index}")
        feeds = step_feeds(a, self.slot_lengths)
        for name, arr in feeds.items():
            set_shape(ctx, name, arr.shape, profile)
            self._bind(name, self._upload(name, np.ascontiguousarray(arr)))
        batch = len(a.slots)
        for i, pair in enumerate(self.kv):
            for kind, ptr in zip(("key", "value"), pair, strict=True):
                shape = (batch, self.cfg.num_kv_heads, self.capacity, self.cfg.head_dim)
                set_shape(ctx, f"past_{kind}_{i}", shape, profile)
                self._bind(f"past_{kind}_{i}", ptr)
                self._bind(f"present_{kind}_{i}", ptr)  # in place
        logits = np.empty((len(feeds["logits_index"]), self.cfg.vocab_size), np.float32)
        out_ptr = self._upload("logits", logits)
        self._bind("logits", out_ptr)
        if not ctx.execute_async_v3(self.stream):
            raise RuntimeError("TensorRT execution failed (execute_async_v3; see its log above)")
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check(self.cudart.cudaMemcpyAsync(logits.ctypes.data, out_ptr, logits.nbytes, kind, self.stream))
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        for r in rows:
            self.slot_lengths[r.slot] = r.start_pos + len(r.token_ids)
        return logits[: len(a.logits_index)]  # without the dummy row of a step that samples none


def load_plan(engine_dir: Path, fields: dict[str, Any], build_model: Callable[[Path], onnx.ModelProto],
              profiles: list[Profile], load: Callable[[bytes], TensorRTRuntime]) -> tuple[CacheEntry, TensorRTRuntime]:
    """The cache entry of ``fields`` with its checked graph and plan (built when absent or
    unusable) and the runtime ``load`` makes of the plan. The plan is built in the entry's build
    folder, written atomically and put in the manifest before the entry is published; a plan
    ``load`` cannot use (:class:`PlanError`) drops the entry and builds once more."""
    from inferflow.runtimes.engine_cache import MODEL_FILE, get_or_build, write_atomic
    from inferflow.runtimes.tensorrt_graph import check_graph

    def build_plan(folder: Path) -> None:
        model_path = folder / MODEL_FILE
        check_graph(onnx.load(str(model_path), load_external_data=False))
        write_atomic(folder / PLAN_FILE, build_serialized_engine(str(model_path), profiles))

    for attempt in (1, 2):
        entry = get_or_build(engine_dir, fields, build_model, finish=build_plan)
        try:
            if PLAN_FILE not in entry.manifest.get("files", {}):
                raise PlanError(f"{entry.path} has no {PLAN_FILE} in its manifest")
            return entry, load((entry.path / PLAN_FILE).read_bytes())
        except PlanError as exc:
            if attempt == 2:
                raise PlanError(f"{exc}; a fresh build of {entry.path} did not load either") from exc
            log.warning("TensorRT plan %s is unusable (%s); rebuilding it", entry.path, exc)
            shutil.rmtree(entry.path, ignore_errors=True)
    raise AssertionError("unreachable")


class TensorRTRunner:
    """The engine interface of :class:`OnnxRuntimeRunner` (forward, load/save_blocks) on a GPU.

    The canonical ONNX graph and the TensorRT plan are both cached in the engine's
    ``compiled_engines/<key>/`` folder; the key includes the TensorRT version and the GPU, so a
    plan is never loaded on a runtime or device it was not built for.
    """

    def __init__(self, checkpoint: Checkpoint, settings: OrtSettings, layout: KVLayout) -> None:
        from inferflow.models.llama_graph import GRAPH_BUILDER_VERSION, GraphSpec
        from inferflow.runtimes.llama_build import build_llama_engine

        trt, cudart = import_tensorrt(), import_cudart()
        _check(cudart.cudaSetDevice(settings.device_id))
        props = _check(cudart.cudaGetDeviceProperties(settings.device_id))
        cfg = checkpoint.config
        self.model_config, self.settings, self.layout = cfg, settings, layout
        self.capacity = min(layout.max_model_len, cfg.max_position_embeddings)
        cfg.check_context(checkpoint.path / "config.json", self.capacity, "max_model_len")
        max_chunk, max_tokens = step_limits(self.capacity, settings.max_num_batched_tokens)
        alloc = self.capacity + max_chunk  # headroom for idle slots' padded writes
        spec = GraphSpec("canonical", settings.precision, alloc, settings.quant_block_size)
        fields = {"weights_digest": checkpoint.weights_digest, "builder_version": GRAPH_BUILDER_VERSION,
                  "graph_form": "canonical", "precision": settings.precision, "max_model_len": alloc,
                  "tensorrt_version": trt.__version__, "gpu": bytes(props.name).rstrip(b"\0").decode(),
                  "compute_capability": f"{props.major}.{props.minor}", "max_slots": layout.max_slots,
                  "max_num_batched_tokens": max_tokens}
        profiles = optimization_profiles(cfg, layout.max_slots, alloc, max_chunk, max_tokens)
        self.cache_entry, self.runtime = load_plan(
            settings.engine_dir, fields, lambda folder: build_llama_engine(checkpoint, spec, folder),
            profiles, lambda plan: TensorRTRuntime(plan, cfg, layout.max_slots, alloc, spec.act_dtype,
                                                   profiles))
        self.block_bytes = cfg.num_kv_heads * layout.block_size * cfg.head_dim * np.dtype(spec.act_dtype).itemsize
        self.pool = [[_check(cudart.cudaMalloc(self.block_bytes * layout.num_blocks)) for _ in range(2)]
                     for _ in range(cfg.num_layers)]

    def close(self) -> None:
        """The runtime (context, engine, TensorRT runtime, KV buffers), then the block pool."""
        self.runtime.close()
        for ptr in [p for pair in self.pool for p in pair]:
            _check(self.runtime.cudart.cudaFree(ptr))
        self.pool = []

    @property
    def num_slots(self) -> int:
        return int(self.layout.max_slots)

    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        return self.runtime.forward(rows)

    def _copy_blocks(self, copies: Sequence[KVBlockCopy], to_pool: bool) -> None:
        """Strided device copies: a block is Hkv runs of block_size*D contiguous elements."""
        rt, cfg = self.runtime, self.model_config
        item = rt.itemsize
        run = self.layout.block_size * cfg.head_dim * item  # bytes of one head's block
        slot_pitch = rt.capacity * cfg.head_dim * item  # bytes between heads in a slot
        kind = rt.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        for c in copies:
            for layer in range(cfg.num_layers):
                for k in range(2):
                    slot_ptr = rt.kv[layer][k] + c.slot * rt.slot_bytes + c.block_index * run
                    block_ptr = self.pool[layer][k] + c.block_id * self.block_bytes
                    src, spitch, dst, dpitch = (slot_ptr, slot_pitch, block_ptr, run) if to_pool \
                        else (block_ptr, run, slot_ptr, slot_pitch)
                    _check(rt.cudart.cudaMemcpy2DAsync(dst, dpitch, src, spitch, run, cfg.num_kv_heads,
                                                       kind, rt.stream))

    def load_blocks(self, copies: Sequence[KVBlockCopy]) -> None:
        self._copy_blocks(copies, to_pool=False)

    def save_blocks(self, copies: Sequence[KVBlockCopy]) -> None:
        self._copy_blocks(copies, to_pool=True)
        _check(self.runtime.cudart.cudaStreamSynchronize(self.runtime.stream))
