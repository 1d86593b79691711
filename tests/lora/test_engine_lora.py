"""Multi-LoRA through the whole engine (issue 43): ``LLM(lora_adapters=...)`` on a tiny seeded
Llama with two random PEFT adapters (made by peft itself, ``inferflow.testing.lora``).

Oracle: transformers + ``peft.PeftModel`` greedy decoding, one request at a time (and the merged
weights' model agrees with it). The engine runs the base model and both adapters in the same
steps, prefill chunks and decode rows mixed, and must match token for token: on ONNX Runtime
(paged pool and ``graph_form=gqa`` slots) and torch; with ``max_loras=1`` too, where adapters
take turns in the single slot (evicted and written again); and again on a warm prefix cache,
whose blocks are keyed by adapter (a block shared across adapters changes the output). Adapters
are loaded and unloaded while requests run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferflow.engine.llm_engine import LLMEngine, RequestRejected
from inferflow.llm import LLM
from inferflow.lora import LoraError
from inferflow.models.tiny import TinySpec, make_checkpoint
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.integrity import check_scheduler
from inferflow.testing.lora import (
    base_reference,
    make_peft_adapter,
    merged_reference,
    peft_reference,
)

pytest.importorskip("torch")  # (the oracles: transformers + peft)
pytest.importorskip("transformers")
pytest.importorskip("peft")

N_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
ADAPTERS = ("a", "b")


@dataclass
class Setup:
    base: Path
    adapters: dict[str, Path]
    prompts: list[list[int]]
    want: dict[str | None, list[list[int]]]  # adapter (None: base) -> greedy ids per prompt


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("engine_lora")
    base = make_checkpoint(root / "base", TinySpec(num_layers=2), seed=3)
    adapters = {
        # all seven projections; attention only, another rank, rsLoRA scaling
        "a": make_peft_adapter(base, root / "a", rank=8, alpha=16, seed=1),
        "b": make_peft_adapter(base, root / "b", rank=4, alpha=8, seed=2, rslora=True,
                               targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    }
    rng = np.random.default_rng(0)
    # longer than a block (16): a warm prefix cache has full blocks to offer
    prompts = [rng.integers(1, 1000, n).tolist() for n in (37, 21, 50)]
    want: dict[str | None, list[list[int]]] = {None: base_reference(base, prompts, N_NEW)}
    for name, path in adapters.items():
        want[name] = peft_reference(base, path, prompts, N_NEW)
    assert want["a"] != want[None] and want["b"] != want[None] and want["a"] != want["b"]
    assert merged_reference(base, adapters["a"], prompts, N_NEW) == want["a"]
    return Setup(base, adapters, prompts, want)


def executor_kw(executor: str) -> dict[str, Any]:
    """``LLM`` keywords of one executor: ONNX Runtime's paged pool or slots (gqa), or torch."""
    if executor == "paged":
        from inferflow.runtimes.ort_ops.build import op_status

        available, reason = op_status()
        if not available:
            pytest.skip(f"the paged-attention op is not available: {reason}")
        return {"graph_form": "paged", "num_blocks": 96}
    if executor == "gqa":
        return {"graph_form": "gqa", "max_slots": 9}
    return {"backend": "torch", "compile": "eager", "num_blocks": 96}


def mixed(setup: Setup) -> tuple[list[list[int]], list[str | None], list[list[int]]]:
    """Every prompt with the base model and each adapter: (prompts, adapters, expected ids)."""
    prompts, loras, want = [], [], []
    for i, prompt in enumerate(setup.prompts):
        for name in (None, *ADAPTERS):
            prompts.append(prompt)
            loras.append(name)
            want.append(setup.want[name][i])
    return prompts, loras, want


def ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("max_loras", [2, 1])
@pytest.mark.parametrize("executor", ["paged", "gqa", "torch"])
def test_mixed_steps_match_peft(setup: Setup, executor: str, max_loras: int) -> None:
    llm = LLM(setup.base, lora_adapters=setup.adapters, max_loras=max_loras, max_lora_rank=8,
              max_num_seqs=9, max_model_len=128, **executor_kw(executor))
    engine = llm.engine
    assert engine.lora_names() == ["a", "b"]
    prompts, loras, want = mixed(setup)
    mixed_steps: list[set[str | None]] = []
    record = engine.scheduler.schedule

    def schedule() -> Any:  # (the adapters of each plan, to see that steps mix them)
        plan = record()
        mixed_steps.append({c.lora for c in plan.chunks})
        return plan

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    assert ids(llm.generate(prompts, GREEDY, lora=loras)) == want
    assert max(len(s - {None}) for s in mixed_steps) == max_loras  # never more
    assert any(None in s and len(s) > 1 for s in mixed_steps)  # the base beside adapters
    # again, on a warm prefix cache: each adapter's own blocks only
    assert ids(llm.generate(prompts, GREEDY, lora=loras)) == want
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.max_loras == max_loras
    assert (stats.lora_loads, stats.running_loras, stats.waiting_loras) == (2, (), ())
    if max_loras == 1:  # a and b took turns in the one slot, more than once
        assert stats.lora_slot_loads >= 3
    check_scheduler(engine.scheduler)
    assert stats.num_kv_blocks_used == 0


def drain(engine: LLMEngine, done: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)


@pytest.mark.parametrize("executor", ["gqa", "torch"])
def test_load_and_unload_while_requests_run(setup: Setup, executor: str) -> None:
    llm = LLM(setup.base, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4,
              max_model_len=128, **executor_kw(executor))
    engine = llm.engine
    assert engine.lora_names() == []
    engine.load_lora("a", str(setup.adapters["a"]))
    p0, p1 = setup.prompts[0], setup.prompts[1]
    engine.add_request("a0", p0, GREEDY, lora="a")
    engine.add_request("base0", p0, GREEDY)
    done: dict[str, list[int]] = {}
    for _ in range(2):
        engine.step()
    engine.load_lora("b", str(setup.adapters["b"]))  # into a free slot, while a runs
    engine.add_request("b1", p1, GREEDY, lora="b")
    engine.unload_lora("a")  # a0 still runs: it finishes with a
    assert engine.lora_names() == ["b"]
    with pytest.raises(RequestRejected) as info:
        engine.add_request("a1", p1, GREEDY, lora="a")
    assert info.value.field == "model"
    with pytest.raises(LoraError, match="being unloaded"):
        engine.load_lora("a", str(setup.adapters["a"]))
    with pytest.raises(LoraError, match="not loaded"):
        engine.unload_lora("a")
    drain(engine, done)
    assert done == {"a0": setup.want["a"][0], "base0": setup.want[None][0],
                    "b1": setup.want["b"][1]}
    assert engine.lora is not None and "a" not in engine.lora  # gone once a0 finished
    stats = engine.stats()
    assert (stats.lora_loads, stats.lora_unloads) == (2, 1)
    # the name is free again, for other weights: its old slot must not serve them
    engine.load_lora("a", str(setup.adapters["b"]))
    engine.add_request("a2", p0, GREEDY, lora="a")
    engine.add_request("b2", p0, GREEDY, lora="b")
    drain(engine, done)
    assert done["a2"] == done["b2"] == setup.want["b"][0]
    check_scheduler(engine.scheduler)


def test_refusals(setup: Setup) -> None:
    llm = LLM(setup.base, lora_adapters={"a": setup.adapters["a"]}, max_lora_rank=8,
              graph_form="gqa", max_slots=2, max_model_len=128)
    engine = llm.engine
    with pytest.raises(RequestRejected) as info:
        engine.add_request("x", setup.prompts[0], GREEDY, lora="missing")
    assert info.value.field == "model" and "'missing' does not exist" in str(info.value)
    with pytest.raises(LoraError) as lora_info:
        engine.load_lora("base", str(setup.adapters["b"]))  # the checkpoint folder's name
    assert lora_info.value.field == "lora_name" and "served model" in str(lora_info.value)
    with pytest.raises(LoraError, match="already loaded"):
        engine.load_lora("a", str(setup.adapters["b"]))
    with pytest.raises(LoraError) as path_info:
        engine.load_lora("c", str(setup.base / "nowhere"))
    assert path_info.value.field == "lora_path"
    with pytest.raises(ValueError) as rank_info:  # rank 8 > max_lora_rank 4: one line
        LLM(setup.base, lora_adapters={"a": setup.adapters["a"]}, max_lora_rank=4,
            graph_form="gqa", max_slots=2, max_model_len=128)
    message = str(rank_info.value)
    assert message.startswith("lora.adapters.a: ") and "rank" in message and "\n" not in message
    plain = LLM(setup.base, graph_form="gqa", max_slots=2, max_model_len=128)
    assert plain.engine.lora is None and plain.engine.describe()["lora"] == {"enabled": False}
    with pytest.raises(RequestRejected):
        plain.engine.add_request("x", setup.prompts[0], GREEDY, lora="a")
    with pytest.raises(LoraError, match="serves no LoRA adapters"):
        plain.engine.load_lora("a", str(setup.adapters["a"]))
