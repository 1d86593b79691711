"""``inferflow.PagedAttention`` (the ONNX Runtime custom op of ``runtimes/ort_ops``) against a
numpy reference of its contract, one single-node model per case, on scattered blocks: block
ids drawn from a permutation, block 0 the null block, every cache position that no row owns
(and every block table entry outside a window) NaN, so a kernel that reads what it must not
fails. Also: in place through IOBinding, only the written slots change, the kernel sets
(AVX-512, AVX2, portable) agree, bad inputs are refused, the build cache is reused and keyed by
content, ``INFERFLOW_ORT_OP=off`` and the header unpacking.

The op is built once per session (the headers are fetched when not installed: the suite's one
download, 85 kB); every test that needs it skips, with the reason, when it cannot be built.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from inferflow.runtimes.ort_ops import build, headers

INPUTS = ("qkv", "key_cache", "value_cache", "positions", "slot_mapping", "block_tables",
          "seq_lens", "query_start", "cos_cache", "sin_cache")
OUTPUTS = ("out", "key_cache_out", "value_cache_out")
NULL_BLOCK = 0


# ---------------------------------------------------------------------------------------------
# the reference


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int) -> np.ndarray:
    """Non-interleaved rotary of x (tokens, heads, D) over its first rotary_dim dims; cos, sin
    (tokens, rotary_dim / 2)."""
    h = rotary_dim // 2
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :h], x[..., h:rotary_dim]
    out[..., :h] = x1 * c - x2 * s
    out[..., h:rotary_dim] = x2 * c + x1 * s
    return out


def reference(feeds: dict[str, np.ndarray], *, num_heads: int, kv_num_heads: int,
              scale: float = 0.0, softcap: float = 0.0, window: int = 0,
              rotary_dim: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The op's contract in float64: (out, key cache after, value cache after)."""
    kc, vc = feeds["key_cache"].copy(), feeds["value_cache"].copy()
    _, hkv, bs, d = kc.shape
    hq, n = num_heads, feeds["qkv"].shape[0]
    group = hq // hkv
    x = feeds["qkv"].astype(np.float64).reshape(n, hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    if rotary_dim:
        pos = feeds["positions"]
        cos = feeds["cos_cache"][pos].astype(np.float64)
        sin = feeds["sin_cache"][pos].astype(np.float64)
        q, k = rotate(q, cos, sin, rotary_dim), rotate(k, cos, sin, rotary_dim)
    blocks, offsets = np.divmod(feeds["slot_mapping"], bs)
    kc[blocks, :, offsets] = k.astype(kc.dtype)  # the write comes first: a chunk sees itself
    vc[blocks, :, offsets] = v.astype(vc.dtype)
    scale = scale or 1.0 / np.sqrt(d)
    out = np.zeros((n, hq, d))
    starts, seq_lens = feeds["query_start"], feeds["seq_lens"]
    for b, length in enumerate(seq_lens):
        first, end = int(starts[b]), int(starts[b + 1])
        if end == first:
            continue
        keys_at = np.arange(int(length))
        table = feeds["block_tables"][b]
        query_pos = np.arange(int(length) - (end - first), int(length))  # (Q,)
        visible = keys_at[None, :] <= query_pos[:, None]  # (Q, L)
        if window:
            visible &= keys_at[None, :] > query_pos[:, None] - window
        used = visible.any(0)  # keys some query sees; the others may be NaN (freed blocks)
        keys = kc[table[keys_at[used] // bs], :, keys_at[used] % bs].astype(np.float64)  # (L', Hkv, D)
        values = vc[table[keys_at[used] // bs], :, keys_at[used] % bs].astype(np.float64)
        kh = np.repeat(keys, group, axis=1)  # (L', Hq, D): query head h reads kv head h // G
        vh = np.repeat(values, group, axis=1)
        scores = np.einsum("qhd,lhd->qhl", q[first:end], kh) * scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        scores = np.where(visible[:, None, used], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[first:end] = np.einsum("qhl,lhd->qhd", weights, vh)
    return out.reshape(n, hq * d), kc, vc


def test_reference_is_causal_softmax_attention_on_one_contiguous_row() -> None:
    """The oracle itself, against the textbook formula (one row, blocks in order, G = 1)."""
    rng = np.random.default_rng(3)
    length, heads, d, bs = 20, 2, 8, 4
    q, k, v = (rng.standard_normal((length, heads, d)) for _ in range(3))
    feeds = {"qkv": np.concatenate([q, k, v], 1).reshape(length, -1).astype(np.float32),
             "key_cache": np.zeros((5, heads, bs, d), np.float32),
             "value_cache": np.zeros((5, heads, bs, d), np.float32),
             "positions": np.arange(length), "slot_mapping": np.arange(length),
             "block_tables": np.arange(5, dtype=np.int32)[None], "seq_lens": np.array([length]),
             "query_start": np.array([0, length])}
    out, _, _ = reference(feeds, num_heads=heads, kv_num_heads=heads)
    q32, k32, v32 = (feeds["qkv"].reshape(length, 3, heads, d)[:, i].astype(np.float64) for i in range(3))
    scores = np.einsum("qhd,khd->hqk", q32, k32) / np.sqrt(d)
    scores[:, np.triu(np.ones((length, length), bool), 1)] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("hqk,khd->qhd", weights, v32).reshape(length, -1)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case:
    rows: tuple[tuple[int, int], ...]  # (tokens already cached, tokens this step) per row
    num_heads: int = 12
    kv_num_heads: int = 4
    head_dim: int = 64
    rotary_dim: int = -1  # -1: head_dim
    scale: float = 0.0
    softcap: float = 0.0
    window: int = 0
    block_size: int = 16
    t: type = np.float32
    tkv: type = np.float32

    @property
    def attrs(self) -> dict[str, object]:
        rot = self.head_dim if self.rotary_dim < 0 else self.rotary_dim
        return {"num_heads": self.num_heads, "kv_num_heads": self.kv_num_heads, "scale": self.scale,
                "softcap": self.softcap, "window": self.window, "rotary_dim": rot}


def make_feeds(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows on scattered blocks of a NaN-filled pool; each row's cached positions random."""
    rng = np.random.default_rng(seed)
    bs, hkv, d = case.block_size, case.kv_num_heads, case.head_dim
    need = [-(-(c + q) // bs) for c, q in case.rows]
    num_blocks = sum(need) + 3  # + the null block and two nobody owns
    ids = rng.permutation(np.arange(1, num_blocks))
    width = max(need) + 1  # one spare entry: the null block
    tables = np.full((len(case.rows), width), NULL_BLOCK, np.int32)
    kc = np.full((num_blocks, hkv, bs, d), np.nan, case.tkv)
    vc = np.full_like(kc, np.nan)
    positions, slots, seq_lens, starts = [], [], [], [0]
    taken = 0
    for b, (cached, new) in enumerate(case.rows):
        blocks = ids[taken:taken + need[b]]
        taken += need[b]
        tables[b, :len(blocks)] = blocks
        for p in range(cached):  # the row's context, as earlier steps left it
            kc[blocks[p // bs], :, p % bs] = rng.standard_normal((hkv, d))
            vc[blocks[p // bs], :, p % bs] = rng.standard_normal((hkv, d))
        if case.window and new:  # blocks wholly before the first query's window: freed
            first_visible = max(0, cached - case.window + 1)
            tables[b, :first_visible // bs] = NULL_BLOCK
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(int(blocks[p // bs]) * bs + p % bs)
        seq_lens.append(cached + new)
        starts.append(starts[-1] + new)
    rot = case.attrs["rotary_dim"]
    assert isinstance(rot, int)
    half = max(rot // 2, 1)
    angles = np.arange(max(seq_lens) + 5)[:, None] * 10000.0 ** (-np.arange(half) / half)
    n = len(positions)
    return {
        "qkv": rng.standard_normal((n, (case.num_heads + 2 * hkv) * d)).astype(case.t),
        "key_cache": kc, "value_cache": vc,
        "positions": np.array(positions, np.int64), "slot_mapping": np.array(slots, np.int64),
        "block_tables": tables, "seq_lens": np.array(seq_lens, np.int32),
        "query_start": np.array(starts, np.int32),
        "cos_cache": np.cos(angles).astype(np.float32)[:, :rot // 2],
        "sin_cache": np.sin(angles).astype(np.float32)[:, :rot // 2],
    }


def one_node_model(case: Case) -> bytes:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(case.t))
    kv = helper.np_dtype_to_tensor_dtype(np.dtype(case.tkv))
    types = [elem, kv, kv, TensorProto.INT64, TensorProto.INT64, TensorProto.INT32,
             TensorProto.INT32, TensorProto.INT32, TensorProto.FLOAT, TensorProto.FLOAT]
    inputs = [helper.make_tensor_value_info(name, ty, None) for name, ty in zip(INPUTS, types, strict=True)]
    outputs = [helper.make_tensor_value_info(name, ty, None) for name, ty in zip(OUTPUTS, (elem, kv, kv), strict=True)]
    node = helper.make_node("PagedAttention", list(INPUTS), list(OUTPUTS), domain="inferflow", **case.attrs)
    model = helper.make_model(helper.make_graph([node], "paged_attention", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("inferflow", 1)])
    model.ir_version = 9
    return model.SerializeToString()


def session(library: Path, case: Case, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(one_node_model(case), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def library() -> Path:
    try:
        return build.paged_attention_library()
    except build.OpUnavailable as exc:
        pytest.skip(f"inferflow.PagedAttention cannot be built here: {exc}")


@pytest.fixture(params=["native", "avx2", "portable"])
def kernel_set(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The kernel set the next sessions get (read when a session creates its kernel)."""
    if request.param != "native":
        monkeypatch.setenv("INFERFLOW_ORT_OP_ISA", request.param)
    yield request.param


def check(case: Case, feeds: dict[str, np.ndarray], got: list[np.ndarray]) -> None:
    """got (out, key cache, value cache) against the reference; the caches changed only at the
    slots in slot_mapping."""
    want = reference(feeds, **case.attrs)  # type: ignore[arg-type]
    out_tol = 3e-3 if case.t == np.float16 else 5e-4 if case.tkv == np.float16 else 2e-5
    np.testing.assert_allclose(got[0].astype(np.float64), want[0], rtol=out_tol, atol=out_tol)
    cache_tol = 1e-3 if case.tkv == np.float16 else 1e-6
    for name, cache, expected in zip(("key_cache", "value_cache"), got[1:], want[1:], strict=True):
        before = feeds[name]
        changed = ~((cache == before) | (np.isnan(cache) & np.isnan(before))).all(axis=(1, 3))  # (NB, bs)
        bs = before.shape[2]
        assert set(zip(*np.nonzero(changed), strict=True)) <= {divmod(int(s), bs) for s in feeds["slot_mapping"]}
        np.testing.assert_allclose(cache.astype(np.float64), expected.astype(np.float64),
                                   rtol=cache_tol, atol=cache_tol, equal_nan=True)


CASES = {
    "one_decode": Case(rows=((5, 1),)),
    "decode_and_prefill_mixed": Case(rows=((37, 1), (0, 23), (100, 1), (0, 0), (5, 40), (16, 1))),
    "chunks_continue_rows": Case(rows=((48, 32), (17, 70), (200, 3))),
    "gqa_group_1": Case(rows=((20, 1), (3, 30)), num_heads=4, kv_num_heads=4, head_dim=16),
    "gqa_group_4": Case(rows=((20, 1), (3, 30)), num_heads=16, kv_num_heads=4, head_dim=128),
    "gqa_group_8": Case(rows=((20, 1), (3, 30), (90, 2)), num_heads=16, kv_num_heads=2),
    "window": Case(rows=((100, 1), (0, 90), (60, 50), (33, 1)), window=37),
    "window_of_one": Case(rows=((9, 1), (0, 20)), window=1),
    "softcap_and_scale": Case(rows=((30, 1), (0, 45)), softcap=5.0, scale=0.3),
    "partial_rotary": Case(rows=((30, 1), (10, 33)), rotary_dim=16),
    "no_rotary": Case(rows=((30, 1), (10, 33)), rotary_dim=0),
    "head_dim_80": Case(rows=((30, 1), (10, 33)), head_dim=80, rotary_dim=40),
    "head_dim_96_mqa": Case(rows=((30, 2), (10, 33)), num_heads=8, kv_num_heads=1, head_dim=96),
    "head_dim_256": Case(rows=((20, 1), (5, 17)), num_heads=4, kv_num_heads=2, head_dim=256),
    "block_size_5": Case(rows=((23, 1), (4, 19)), block_size=5),
    "fp16": Case(rows=((37, 1), (0, 23), (48, 40)), t=np.float16, tkv=np.float16),
    "fp32_with_fp16_kv": Case(rows=((37, 1), (0, 23), (48, 40)), tkv=np.float16),
    "fp16_kv_window_softcap": Case(rows=((80, 1), (20, 45)), tkv=np.float16, window=30, softcap=20.0),
    # one long decode row of one KV head: fewer items than threads, so its keys are split
    # between items and merged (on every machine: 2 CPUs or more)
    "split_decode": Case(rows=((700, 1),), num_heads=8, kv_num_heads=1),
    "split_decode_window_softcap": Case(rows=((1000, 1),), num_heads=2, kv_num_heads=1, window=600,
                                        softcap=8.0),
    "split_decode_fp16": Case(rows=((900, 1),), num_heads=8, kv_num_heads=1, t=np.float16, tkv=np.float16),
}
ISA_CASES = ("decode_and_prefill_mixed", "window", "gqa_group_8", "head_dim_80", "fp16",
             "fp32_with_fp16_kv", "softcap_and_scale", "split_decode_window_softcap")


@pytest.mark.slow  # compiles the op once per session
@pytest.mark.parametrize("name", CASES)
def test_op_matches_the_reference(library: Path, name: str) -> None:
    case = CASES[name]
    feeds = make_feeds(case)
    got = session(library, case).run(None, feeds)
    check(case, feeds, got)
    assert np.isfinite(got[0]).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", ISA_CASES)
def test_every_kernel_set_matches_the_reference(library: Path, kernel_set: str, name: str) -> None:
    case = CASES[name]
    feeds = make_feeds(case, seed=1)
    check(case, feeds, session(library, case).run(None, feeds))


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_in_place_through_io_binding(library: Path, threads: int) -> None:
    """The runner's way: outputs 1, 2 bound to the input caches' memory; the op writes there."""
    case = CASES["decode_and_prefill_mixed"]
    feeds = make_feeds(case)
    before = {name: feeds[name].copy() for name in ("key_cache", "value_cache")}
    sess = session(library, case, threads)
    binding = sess.io_binding()
    for name in INPUTS:
        binding.bind_cpu_input(name, feeds[name])
    binding.bind_output("out", "cpu")
    for name in ("key_cache", "value_cache"):
        cache = feeds[name]
        binding.bind_output(f"{name}_out", "cpu", 0, cache.dtype, cache.shape, cache.ctypes.data)
    sess.run_with_iobinding(binding)
    out = binding.copy_outputs_to_cpu()[0]
    check(case, {**feeds, **before}, [out, feeds["key_cache"], feeds["value_cache"]])


@pytest.mark.slow
def test_an_integer_scale_attribute_is_read(library: Path) -> None:
    """scale=1 written as an INT attribute (what onnx.helper makes of a Python int) is 1, not 0."""
    case = Case(rows=((12, 1), (0, 9)), scale=1.0)
    feeds = make_feeds(case)
    as_int = Case(rows=case.rows, scale=1)  # type: ignore[arg-type]
    np.testing.assert_array_equal(session(library, as_int).run(["out"], feeds)[0],
                                  session(library, case).run(["out"], feeds)[0])


@pytest.mark.slow
def test_functional_run_leaves_the_inputs_alone(library: Path) -> None:
    case = CASES["chunks_continue_rows"]
    feeds = make_feeds(case)
    kept = {name: feeds[name].copy() for name in ("key_cache", "value_cache")}
    got = session(library, case).run(None, feeds)
    for name, cache in kept.items():
        np.testing.assert_array_equal(feeds[name], cache)
    assert not np.array_equal(got[1], kept["key_cache"], equal_nan=True)


@pytest.mark.slow
@pytest.mark.parametrize(("field", "value", "message"), [
    ("slot_mapping", 10**6, "slot_mapping"),
    ("block_tables", 999, "block id 999"),
    ("seq_lens", 0, "seq_len below"),
])
def test_bad_inputs_are_refused(library: Path, field: str, value: int, message: str) -> None:
    case = CASES["one_decode"]
    feeds = make_feeds(case)
    feeds[field] = np.full_like(feeds[field], value)
    with pytest.raises(Exception, match=message):
        session(library, case).run(None, feeds)


def gqa_session(rows: int, tokens: int, case: Case, capacity: int) -> ort.InferenceSession:
    """com.microsoft::GroupQueryAttention as the ``gqa`` graph form emits it: packed QKV,
    rotary inside, past and present one slot buffer of ``capacity`` positions per row."""
    hq, hkv, d = case.num_heads, case.kv_num_heads, case.head_dim
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("qkv", f32, [rows, tokens, (hq + 2 * hkv) * d]),
              helper.make_tensor_value_info("past_key", f32, [rows, hkv, capacity, d]),
              helper.make_tensor_value_info("past_value", f32, [rows, hkv, capacity, d]),
              helper.make_tensor_value_info("seqlens_k", i32, [rows]),
              helper.make_tensor_value_info("total", i32, []),
              helper.make_tensor_value_info("cos", f32, None), helper.make_tensor_value_info("sin", f32, None)]
    outputs = [helper.make_tensor_value_info(name, f32, None) for name in ("out", "present_key", "present_value")]
    node = helper.make_node(
        "GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
        ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=hq, kv_num_heads=hkv,
        do_rotary=1, rotary_interleaved=0)
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.slow
@pytest.mark.parametrize("rows", [((40, 1), (7, 1), (100, 1)), ((36, 29),)], ids=["decode", "chunk"])
def test_op_matches_group_query_attention(library: Path, rows: tuple[tuple[int, int], ...]) -> None:
    """The attention the CPU engine runs today, on the same K/V held in slots instead of blocks
    (rows of one step share a chunk length: GroupQueryAttention pads to it)."""
    case = Case(rows=rows)
    feeds = make_feeds(case, seed=2)
    capacity = max(c + q for c, q in rows)
    bs, tokens = case.block_size, rows[0][1]
    slots = {name: np.zeros((len(rows), case.kv_num_heads, capacity, case.head_dim), np.float32)
             for name in ("key_cache", "value_cache")}
    for b, (cached, _) in enumerate(rows):  # the row's cached positions, copied out of its blocks
        pos = np.arange(cached)
        blocks = feeds["block_tables"][b][pos // bs]
        for name, slot in slots.items():
            slot[b, :, :cached] = feeds[name][blocks, :, pos % bs].transpose(1, 0, 2)
    gqa = gqa_session(len(rows), tokens, case, capacity).run(["out"], {
        "qkv": feeds["qkv"].reshape(len(rows), tokens, -1), "past_key": slots["key_cache"],
        "past_value": slots["value_cache"], "seqlens_k": feeds["seq_lens"] - 1,
        "total": np.array(capacity, np.int32), "cos": feeds["cos_cache"], "sin": feeds["sin_cache"]})[0]
    got = session(library, case).run(["out"], feeds)[0]
    np.testing.assert_allclose(got, gqa.reshape(got.shape), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# build, cache, availability


@pytest.mark.slow
def test_build_cache_is_reused_and_keyed_by_content(library: Path, tmp_path: Path) -> None:
    again = build.build_library()
    assert again.reused and again.path == library
    assert build.paged_attention_library() == library  # memoised
    assert library.parent.parent.name == "ops" and library.parent.name == again.key
    changed = tmp_path / "src"
    changed.mkdir()
    for name in build.SOURCES:
        shutil.copyfile(build.SOURCE_DIR / name, changed / name)
    with (changed / build.SOURCES[1]).open("a") as f:
        f.write("// changed\n")
    include = headers.ensure_headers()
    command = build.compiler()
    assert build.library_key(build.build_fields(include, command, changed)) != again.key
    assert build.library_key(build.build_fields(include, command)) == again.key


@pytest.mark.slow
def test_a_failed_compile_is_a_reason_and_leaves_nothing(library: Path, tmp_path: Path) -> None:
    broken = tmp_path / "src"
    broken.mkdir()
    for name in build.SOURCES:
        (broken / name).write_text("this is not C++\n")
    engines = tmp_path / "engines"
    with pytest.raises(build.OpUnavailable, match="compiling the op failed"):
        build.build_library(engines, source_dir=broken)
    assert list((engines / "ops").iterdir()) == []  # the temporary build folder is gone


def test_the_off_switch_makes_the_op_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERFLOW_ORT_OP", "off")
    with pytest.raises(build.OpUnavailable, match="disabled by INFERFLOW_ORT_OP=off"):
        build.paged_attention_library()
    assert build.op_status() == (False, "disabled by INFERFLOW_ORT_OP=off")


def test_a_missing_compiler_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(build.OpUnavailable, match="does not run"):
        build.compiler_version(tuple(build.compiler()))


def test_a_library_that_does_not_load_is_a_reason(tmp_path: Path) -> None:
    broken = tmp_path / build.LIBRARY
    broken.write_bytes(b"not an ELF file")
    with pytest.raises(build.OpUnavailable, match="cannot load"):
        build.check_loads(broken)


def test_engine_folder_follows_the_runtimes_rule() -> None:
    from inferflow.runtimes.config import default_engine_dir

    assert build.default_engine_dir() == default_engine_dir()


def fake_deb(files: dict[str, bytes]) -> bytes:
    """An ar archive holding data.tar.xz with ``files`` (as a .deb is built)."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:xz") as tar:
        for name, blob in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    out = b"!<arch>\n"
    for name, blob in (("debian-binary", b"2.0\n"), ("data.tar.xz", tar_bytes.getvalue())):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(blob):<10}`\n".encode() + blob
        out += b"\n" if len(blob) % 2 else b""
    return out


def test_headers_come_out_of_the_package_and_nothing_else() -> None:
    files = {f"./usr/include/onnxruntime/{name}": name.encode() for name in headers.REQUIRED}
    files["./usr/include/onnxruntime/core/providers/resource.h"] = b"r"
    files["./usr/lib/libonnxruntime.so"] = b"elf"
    files["./usr/include/onnxruntime/../../../etc/evil"] = b"x"
    got = headers._headers_from_deb(fake_deb(files))
    assert set(got) == {*headers.REQUIRED, "core/providers/resource.h"}
    assert got["onnxruntime_c_api.h"] == b"onnxruntime_c_api.h"


def test_a_package_with_the_wrong_digest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERFLOW_HOME", str(tmp_path / "home"))
    deb = tmp_path / "fake.deb"
    deb.write_bytes(fake_deb({f"usr/include/onnxruntime/{n}": b"" for n in headers.REQUIRED}))
    with pytest.raises(headers.HeadersUnavailable, match="sha256"):
        headers.fetch_headers(url=deb.as_uri())
    assert not headers.fetched_dir().exists()
    monkeypatch.setattr(headers, "PACKAGE_SHA256", hashlib.sha256(deb.read_bytes()).hexdigest())
    assert headers.fetch_headers(url=deb.as_uri()) == headers.fetched_dir()
    assert headers.complete(headers.fetched_dir())
    assert not [p for p in headers.fetched_dir().parent.iterdir() if p.name.startswith(".")]


def test_an_unreachable_mirror_is_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERFLOW_HOME", str(tmp_path / "home"))
    with pytest.raises(headers.HeadersUnavailable, match="could not fetch"):
        headers.fetch_headers(url=(tmp_path / "absent.deb").as_uri())
