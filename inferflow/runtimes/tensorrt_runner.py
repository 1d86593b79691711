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

Memory: per layer one device buffer each for K and V of shape (max_slots, Hkv, C_alloc, D);
``past_*`` and ``present_*`` are bound to the same address (TensorScatter lowers to an in-place
KV-cache update). Each call runs over slots [0, B): idle slots write their padded garbage at their
current length, which must stay inside the buffer, hence ``C_alloc = max_model_len + max_chunk``
(headroom for one padded chunk) while the scheduler only ever uses ``max_model_len`` positions.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from inferflow.models.config import ModelArch
from inferflow.runtimes.step_inputs import EngineRow, StepArrays, build_step_arrays

if TYPE_CHECKING:
    from inferflow.models.checkpoint import Checkpoint
    from inferflow.runtimes.config import OrtSettings
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.plan import KVBlockCopy

INSTALL_HINT = "TensorRT is not installed: pip install 'inferflow[tensorrt]' (needs an NVIDIA GPU)"


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
    logger = trt.Logger(trt.Logger.WARNING)
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
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
        self.context = self.engine.create_execution_context()
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


class TensorRTRunner:
    """The engine interface of :class:`OnnxRuntimeRunner` (forward, load/save_blocks) on a GPU.

    The canonical ONNX graph and the TensorRT plan are both cached in the engine's
    ``compiled_engines/<key>/`` folder; the key includes the TensorRT version and the GPU, so a
    plan is never loaded on a runtime or device it was not built for.
    """

    def __init__(self, checkpoint: Checkpoint, settings: OrtSettings, layout: KVLayout) -> None:
        from inferflow.models.llama_graph import GRAPH_BUILDER_VERSION, GraphSpec
        from inferflow.runtimes.engine_cache import get_or_build
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
        self.cache_entry = get_or_build(settings.engine_dir, fields,
                                        lambda folder: build_llama_engine(checkpoint, spec, folder))
        plan_path = self.cache_entry.path / "engine.plan"
        profiles = optimization_profiles(cfg, layout.max_slots, alloc, max_chunk, max_tokens)
        if not plan_path.exists():
            plan_path.write_bytes(build_serialized_engine(str(self.cache_entry.model_path), profiles))
        self.runtime = TensorRTRuntime(plan_path.read_bytes(), cfg, layout.max_slots, alloc, spec.act_dtype,
                                       profiles)
        self.block_bytes = cfg.num_kv_heads * layout.block_size * cfg.head_dim * np.dtype(spec.act_dtype).itemsize
        self.pool = [[_check(cudart.cudaMalloc(self.block_bytes * layout.num_blocks)) for _ in range(2)]
                     for _ in range(cfg.num_layers)]

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
