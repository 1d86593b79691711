"""The TensorRT path on a machine without TensorRT (issue 45).

The canonical graph the plan is built from is exported for real and inspected with ``onnx``
against every documented constraint of the TensorRT layers it relies on
(``runtimes/tensorrt_graph.py`` names the sources): a static KV length, TensorScatter's axis -2,
cache inputs that are network inputs aliased to network outputs of the same shape, Attention's
four 4-D inputs and no unsupported attribute, INT64 rotary positions, INT4-only weight-only
dequantization with constant block scales, and types that agree without casts (strongly typed).
Only the ``tensorrt``/``cuda`` module boundary is faked, to test the runtime's lifetimes, the
plan cache (atomic write, manifest digest, rebuild of a plan TensorRT cannot load) and the
bindings of one step.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from engine_factories import make_named_checkpoint
from onnx import TensorProto

from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.llama_graph import GraphSpec, build_llama_graph
from inferflow.runtimes import engine_cache
from inferflow.runtimes import tensorrt_runner as trt_runner
from inferflow.runtimes.engine_cache import MANIFEST, get_or_build, write_atomic
from inferflow.runtimes.llama_build import build_llama_engine
from inferflow.runtimes.step_inputs import EngineRow
from inferflow.runtimes.tensorrt_graph import check_graph, graph_violations, infer_types

CAPACITY = 96  # the graph's static KV length (max_model_len + one chunk of headroom)


def canonical(path: Path, precision: str, capacity: int = CAPACITY) -> onnx.ModelProto:
    ck = load_checkpoint(path)
    dtype = np.float16 if precision == "fp16" else np.float32
    with ck.open_weights(dtype) as weights:
        return build_llama_graph(ck.config, weights, GraphSpec("canonical", precision, capacity))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_named_checkpoint(tmp_path_factory.mktemp("trt"), "gqa8x2")


ACT = {
    "fp32": TensorProto.FLOAT,
    "fp16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
    "int4": TensorProto.FLOAT,
}


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int4"])
def test_the_canonical_graph_meets_every_documented_constraint(ckpt: Path, precision: str) -> None:
    model = canonical(ckpt, precision)
    assert graph_violations(model) == []
    typed = infer_types(model).graph  # strict: raises where an op's inputs disagree in type
    values = {v.name: v for v in [*typed.input, *typed.output, *typed.value_info]}
    inits = {t.name: t for t in typed.initializer}
    inputs, outputs = {v.name: v for v in typed.input}, {v.name: v for v in typed.output}

    def dims(name: str) -> list[int | str]:
        return [d.dim_value or d.dim_param for d in values[name].type.tensor_type.shape.dim]

    def elem(name: str) -> int:
        return int(
            inits[name].data_type if name in inits else values[name].type.tensor_type.elem_type
        )

    scatters = [n for n in typed.node if n.op_type == "TensorScatter"]
    cfg = load_checkpoint(ckpt).config
    assert len(scatters) == 2 * cfg.num_layers
    for node in scatters:  # KVCacheUpdate: axis -2, cache in = network input, static S_max
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        past, update, write, present = *node.input, node.output[0]
        assert attrs["axis"] == -2
        assert (
            past in inputs and present in outputs and present == past.replace("past_", "present_")
        )
        assert dims(past) == ["B", cfg.num_kv_heads, CAPACITY, cfg.head_dim] == dims(present)
        assert len(dims(update)) == 4 and elem(update) == elem(past) == ACT[precision]
        assert elem(write) == TensorProto.INT64 and dims(write) == ["B"]
    for node in (n for n in typed.node if n.op_type == "Attention"):
        attrs = {a.name for a in node.attribute}
        assert len(node.input) == 4 and len(node.output) == 1  # no past/present, no qk output
        assert not attrs & {"softcap", "qk_matmul_output_mode"}
        q, k, v, mask = node.input
        assert k.startswith("present_key_") and v.startswith("present_value_")  # the updated cache
        assert all(len(dims(x)) == 4 for x in node.input)
        assert elem(q) == elem(k) == elem(v) == ACT[precision] and elem(mask) == TensorProto.BOOL
    for node in (n for n in typed.node if n.op_type == "RotaryEmbedding"):
        assert elem(node.input[3]) == TensorProto.INT64
    dequant = [n for n in typed.node if n.op_type == "DequantizeLinear"]
    assert bool(dequant) == (precision == "int4")
    for node in dequant:
        x, scale = node.input[:2]
        assert elem(x) == TensorProto.INT4 and len(node.input) == 2  # no zero point
        assert scale in inits and len(inits[scale].dims) == 2  # a constant block scale
    assert {o.name for o in typed.output} == {"logits"} | {
        f"present_{k}_{i}" for i in range(cfg.num_layers) for k in ("key", "value")
    }
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 24)]


def _set_attr(model: onnx.ModelProto, op: str, name: str, value: Any) -> None:
    for node in model.graph.node:
        if node.op_type == op:
            for a in [a for a in node.attribute if a.name == name]:
                node.attribute.remove(a)
            node.attribute.append(onnx.helper.make_attribute(name, value))


def test_each_documented_constraint_is_detected(ckpt: Path) -> None:
    """The checker is not vacuous: every constraint, broken on purpose, is named."""
    model = canonical(ckpt, "fp32")
    _set_attr(model, "TensorScatter", "axis", 2)
    assert any("axis 2 (TensorRT requires -2)" in v for v in graph_violations(model))

    model = canonical(ckpt, "fp32")
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.name.startswith(("past_", "present_")):
            vi.type.tensor_type.shape.dim[2].dim_param = "C"  # symbolic again
    assert any("needs a static sequence length" in v for v in graph_violations(model))

    model = canonical(ckpt, "fp32")
    _set_attr(model, "Attention", "softcap", 30.0)
    assert any("attribute softcap is unsupported" in v for v in graph_violations(model))

    model = canonical(ckpt, "fp32")
    kept = [o for o in model.graph.output if o.name != "present_key_0"]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    assert any("present_key_0 must be a network output" in v for v in graph_violations(model))

    int8 = canonical(ckpt, "int8")
    assert any("INT8 weight-only" in v for v in graph_violations(int8))
    with pytest.raises(
        ValueError, match=r"breaks TensorRT's documented constraints: .*INT8 weight-only"
    ):
        check_graph(int8)

    model = canonical(ckpt, "fp16")
    weight = next(n.input[1] for n in model.graph.node if n.op_type == "MatMul")
    for init in model.graph.initializer:  # one fp32 weight in an fp16 graph: an implicit cast
        if init.name == weight:
            arr = onnx.numpy_helper.to_array(init).astype(np.float32)
            init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    assert any("types do not agree" in v for v in graph_violations(model))


def test_a_soft_capped_model_is_refused_for_tensorrt(tmp_path: Path) -> None:
    from hf_checkpoints import save_hf_checkpoint

    path = save_hf_checkpoint(tmp_path / "gemma2", "Gemma2ForCausalLM", head_dim=16)
    found = graph_violations(canonical(path, "fp32", 64))
    assert any("softcap is unsupported" in v for v in found)


def test_a_mixture_of_experts_is_refused_for_tensorrt(tmp_path: Path) -> None:
    """The routing sorts all routes with a TopK whose K is the route count (not a constant)."""
    from hf_checkpoints import save_hf_checkpoint

    path = save_hf_checkpoint(
        tmp_path / "mixtral", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2
    )
    found = graph_violations(canonical(path, "fp32", 64))
    assert any(v.startswith("TopK") and "K must be a constant" in v for v in found)
    assert not any("TensorScatter" in v or "Attention" in v for v in found)


def test_tensorrt_refuses_int8_and_onnxruntime_bf16_in_one_line() -> None:
    from inferflow.stages.executor import OnnxRuntimeExecutor, TensorRTExecutor

    with pytest.raises(
        ValueError,
        match=r"^precision: int8 is not offered by executor=tensorrt: .*"
        r"int4.*\(offered: fp32, fp16, bf16, int4\)$",
    ):
        TensorRTExecutor(precision="int8")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^precision: bf16 is not offered by executor=onnxruntime"
    ):
        OnnxRuntimeExecutor(precision="bf16")  # type: ignore[arg-type]
    for ok in ("fp32", "fp16", "bf16", "int4"):
        assert TensorRTExecutor(precision=ok).precision == ok  # type: ignore[arg-type]


# --- the tensorrt / cuda module boundary, faked -------------------------------------------------


class FakeCudart:
    """cuda-python's runtime calls the runner makes: (err, value) tuples, pointers counted."""

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice = 1, 2, 3

    def __init__(self) -> None:
        self.live: set[int] = set()
        self._next = 4096
        self.streams = 0

    def cudaMalloc(self, size: int) -> tuple[int, int]:
        self._next += max(size, 1)
        self.live.add(self._next)
        return 0, self._next

    def cudaFree(self, ptr: int) -> tuple[int]:
        self.live.remove(ptr)
        return (0,)

    def cudaStreamCreate(self) -> tuple[int, int]:
        self.streams += 1
        return 0, 7

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        self.streams -= 1
        return (0,)

    def cudaMemcpyAsync(self, *args: Any) -> tuple[int]:
        return (0,)

    def cudaStreamSynchronize(self, stream: int) -> tuple[int]:
        return (0,)

    def cudaSetDevice(self, device: int) -> tuple[int]:
        return (0,)

    def cudaGetDeviceProperties(self, device: int) -> tuple[int, Any]:
        return 0, SimpleNamespace(name=b"Fake GPU\0\0", major=9, minor=0)


class FakeContext:
    def __init__(self) -> None:
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream: int) -> bool:
        return True


class FakeTensorRT:
    """The ``tensorrt`` calls the runner makes. ``bad_plans``: how many deserializations
    return None; every object records its release in ``released`` (weakref finalizers)."""

    __version__ = "10.99-fake"

    def __init__(self, bad_plans: int = 0) -> None:
        self.bad_plans, self.builds, self.loggers = bad_plans, 0, 0
        self.released: list[str] = []
        self.contexts: list[weakref.ref[FakeContext]] = []
        fake = self

        class Logger:
            WARNING = 2

            def __init__(self, severity: int) -> None:
                fake.loggers += 1

        class Engine:
            def create_execution_context(self) -> FakeContext:
                ctx = FakeContext()
                weakref.finalize(ctx, fake.released.append, "context")
                fake.contexts.append(weakref.ref(ctx))
                return ctx

        class Runtime:
            def __init__(self, logger: Any) -> None:
                assert isinstance(logger, Logger)
                weakref.finalize(self, fake.released.append, "runtime")

            def deserialize_cuda_engine(self, plan: bytes) -> Any:
                assert plan.startswith(b"fake-plan")
                if fake.bad_plans:
                    fake.bad_plans -= 1
                    return None
                engine = Engine()
                weakref.finalize(engine, fake.released.append, "engine")
                return engine

        class Builder:
            def __init__(self, logger: Any) -> None:
                assert isinstance(logger, Logger)

            def create_network(self, flags: int) -> Any:
                return SimpleNamespace()

            def create_builder_config(self) -> Any:
                return SimpleNamespace(
                    set_memory_pool_limit=lambda *a: None, add_optimization_profile=lambda p: None
                )

            def create_optimization_profile(self) -> Any:
                return SimpleNamespace(set_shape=lambda *a: None)

            def build_serialized_network(self, network: Any, config: Any) -> bytes:
                fake.builds += 1
                return b"fake-plan-%d" % fake.builds

        class OnnxParser:
            def __init__(self, network: Any, logger: Any) -> None:
                pass

            def parse_from_file(self, path: str) -> bool:
                return Path(path).exists()

        self.Logger, self.Runtime, self.Builder, self.OnnxParser = (
            Logger,
            Runtime,
            Builder,
            OnnxParser,
        )
        self.NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=0)
        self.MemoryPoolType = SimpleNamespace(WORKSPACE=0)


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTensorRT, FakeCudart]:
    trt, cudart = FakeTensorRT(), FakeCudart()
    monkeypatch.setattr(trt_runner, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_runner, "import_cudart", lambda: cudart)
    return trt, cudart


def runner(ckpt: Path, tmp_path: Path) -> trt_runner.TensorRTRunner:
    from inferflow.runtimes.config import OrtSettings
    from inferflow.scheduling.layout import KVLayout

    settings = OrtSettings(
        precision="fp16",
        graph_form="canonical",
        cache_dir=str(tmp_path / "engines"),
        max_num_batched_tokens=32,
    )
    return trt_runner.TensorRTRunner(load_checkpoint(ckpt), settings, KVLayout.plan(4, 64, 16))


def test_the_plan_is_in_the_manifest_with_its_digest_before_publishing(
    ckpt: Path, tmp_path: Path, fakes: tuple[FakeTensorRT, FakeCudart]
) -> None:
    trt, _ = fakes
    r = runner(ckpt, tmp_path)
    entry = r.cache_entry.path
    plan = (entry / "engine.plan").read_bytes()
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["files"]["engine.plan"] == {
        "size": len(plan),
        "sha256": hashlib.sha256(plan).hexdigest(),
    }
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temp left
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]
    r.close()
    again = runner(ckpt, tmp_path)  # reused, not rebuilt
    assert again.cache_entry.reused and trt.builds == 1
    again.close()
    # a truncated plan fails the manifest's check: the entry is rebuilt, never loaded
    (entry / "engine.plan").write_bytes(plan[:3])
    third = runner(ckpt, tmp_path)
    assert not third.cache_entry.reused and trt.builds == 2
    third.close()


def test_a_plan_tensorrt_cannot_load_is_rebuilt_once_then_a_clear_error(
    ckpt: Path, tmp_path: Path, fakes: tuple[FakeTensorRT, FakeCudart]
) -> None:
    trt, cudart = fakes
    trt.bad_plans = 1
    r = runner(ckpt, tmp_path)  # the first plan deserializes to None: dropped and rebuilt
    assert trt.builds == 2 and (r.cache_entry.path / "engine.plan").read_bytes() == b"fake-plan-2"
    r.close()
    trt.bad_plans = 2
    (r.cache_entry.path / "engine.plan").unlink()  # force a build: two bad plans in a row
    with pytest.raises(
        trt_runner.PlanError, match=r"could not deserialize the plan.*did not load either"
    ):
        runner(ckpt, tmp_path)
    assert not cudart.live  # nothing left allocated by the failed loads


def test_runtime_logger_and_engine_live_together_and_die_in_order(
    ckpt: Path, tmp_path: Path, fakes: tuple[FakeTensorRT, FakeCudart]
) -> None:
    trt, cudart = fakes
    r = runner(ckpt, tmp_path)
    rt = r.runtime
    assert rt.trt_runtime is not None and rt.engine is not None and rt.logger is not None
    assert trt.loggers == 1  # one logger for the builder and the runtime
    assert trt.released == []  # alive while the runner is
    r.close()
    assert trt.released == ["context", "engine", "runtime"]
    assert not cudart.live and cudart.streams == 0
    r.close()  # idempotent
    assert trt.released == ["context", "engine", "runtime"]


def test_one_step_binds_every_graph_tensor_and_aliases_each_cache(
    ckpt: Path, tmp_path: Path, fakes: tuple[FakeTensorRT, FakeCudart]
) -> None:
    trt, _ = fakes
    r = runner(ckpt, tmp_path)
    r.forward([EngineRow(0, (5, 6, 7), 0, True), EngineRow(1, (9,), 4, True)])
    ctx = trt.contexts[-1]()
    assert ctx is not None
    model = onnx.load(str(r.cache_entry.model_path), load_external_data=False)
    names = {v.name for v in [*model.graph.input, *model.graph.output]}
    assert set(ctx.addresses) == names  # every input and output bound, nothing else
    assert set(ctx.shapes) == {v.name for v in model.graph.input}
    for name in (n for n in names if n.startswith("past_")):
        assert ctx.addresses[name] == ctx.addresses[name.replace("past_", "present_")]  # in place
        capacity = (
            next(v for v in model.graph.input if v.name == name)
            .type.tensor_type.shape.dim[2]
            .dim_value
        )
        assert ctx.shapes[name][2] == capacity == r.runtime.capacity  # the static S_max
    # KVCacheUpdate: writeIndices[i] + S <= S_max. A slot writes at most at its length (at most
    # max_model_len) a chunk of at most the prefill profile's S: the headroom covers both
    s_max = r.runtime.profiles[1].shapes["pad_index"][2][1]
    assert r.capacity + s_max <= r.runtime.capacity
    r.close()


def test_write_atomic_leaves_the_old_file_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "engine.plan"
    write_atomic(target, b"old")

    def full(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(engine_cache.os, "fsync", full)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["engine.plan"]


def test_the_plan_is_built_from_the_saved_graph_before_the_entry_is_published(
    tmp_path: Path, ckpt: Path
) -> None:
    seen: list[tuple[bool, bool]] = []

    def finish(folder: Path) -> None:
        published = (tmp_path / "e").exists() and any(
            p.is_dir() and not p.name.startswith(".") for p in (tmp_path / "e").iterdir()
        )
        seen.append(((folder / "model.onnx").exists(), published))
        write_atomic(folder / "engine.plan", b"plan")

    ck = load_checkpoint(ckpt)
    entry = get_or_build(
        tmp_path / "e",
        {"k": 1},
        lambda folder: build_llama_engine(ck, GraphSpec("canonical", "fp32", 64), folder),
        finish=finish,
    )
    assert seen == [(True, False)] and "engine.plan" in entry.manifest["files"]
