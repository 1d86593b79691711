"""EleutherAI's lm-evaluation-harness against a running server, as a user runs it.

``lm-eval`` 0.4.13 with ``--model local-completions`` (echo + logprobs loglikelihood requests,
several prompts per request with ``batch_size`` 4) on small local tasks written here (a
multiple-choice loglikelihood task and a greedy generation task; nothing is downloaded), against
lm-eval's own ``hf`` backend (transformers) on the same seeded checkpoint: every per-item
loglikelihood equal within 1e-3, the same accuracy and the same generations.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

from engine.hf_checkpoints import save_hf_checkpoint  # noqa: E402

NAME = "tiny-hf"
WORDS = [
    "the", "cat", "dog", "sat", "ran", "on", "a", "mat", "in", "big", "red", "blue", "house",
    "tree", "river", "sun", "moon", "one", "two", "three", "four", "five", "and", "is", "was",
    "very", "small",
]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two task YAMLs (lm-eval's ``--include_path``) over local jsonl files."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    rng = random.Random(40)
    mc = [{"question": _sentence(rng, 6), "choices": [_sentence(rng, rng.randint(1, 3))
                                                        for _ in range(4)],
           "answer": rng.randint(0, 3)} for _ in range(16)]
    gen = [{"question": _sentence(rng, 8), "answer": _sentence(rng, 2)} for _ in range(8)]
    for name, rows in (("mc", mc), ("gen", gen)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
              "test_split: test\ndoc_to_text: \"{{{{question}}}}\"\n")
    (root / "mc.yaml").write_text(
        "task: inferflow_mc\n" + common.format(path=root / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\ntarget_delimiter: \" \"\n"
        "metric_list:\n  - metric: acc\n"
    )
    (root / "gen.yaml").write_text(
        "task: inferflow_gen\n" + common.format(path=root / "gen.jsonl")
        + "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_checkpoint(tmp_path_factory.mktemp("lm_eval_ckpt") / "llama", seed=40)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory,
        "lm_eval",
        [f"model.path={checkpoint}", f"model.name={NAME}", "model.max_model_len=512"],
    )
    yield srv
    srv.terminate()


def _evaluate(model: str, model_args: str, tasks: Path, names: list[str],
              monkeypatch: pytest.MonkeyPatch, batch_size: int = 1) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tasks / "hf_home"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=names,
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=batch_size,
        log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )


Outcome = tuple[list[list[float]], float, list[str]]


def _outcome(results: dict[str, Any]) -> Outcome:
    """Each MC item's loglikelihoods (one per choice) and the accuracy; each generation."""
    samples = {t: sorted(s, key=lambda x: x["doc_id"]) for t, s in results["samples"].items()}
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples.get("inferflow_mc", [])]
    acc = results["results"].get("inferflow_mc", {}).get("acc,none", -1.0)
    gens = [s["filtered_resps"][0] for s in samples.get("inferflow_gen", [])]
    return lls, acc, gens


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tasks: Path) -> Outcome:
    """lm-eval's own transformers backend on the checkpoint."""
    with pytest.MonkeyPatch.context() as mp:
        out = _evaluate("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", tasks,
                        ["inferflow_mc", "inferflow_gen"], mp)
    return _outcome(out)


def _served(server: ServerProcess, checkpoint: Path, tasks: Path, names: list[str],
            monkeypatch: pytest.MonkeyPatch, batch_size: int) -> Outcome:
    args = (f"model={NAME},base_url={server.base_url}/v1/completions,num_concurrent=1,"
            f"max_retries=1,tokenizer_backend=huggingface,tokenizer={checkpoint},"
            "add_bos_token=True")  # as the hf backend encodes (the tokenizer adds BOS)
    return _outcome(_evaluate("local-completions", args, tasks, names, monkeypatch, batch_size))


@pytest.mark.parametrize("batch_size", [1, 4])  # 4: several prompts per request
@pytest.mark.parametrize("task", ["inferflow_mc", "inferflow_gen"])
def test_local_completions_equals_the_hf_backend(
    server: ServerProcess, checkpoint: Path, tasks: Path, reference: Outcome, task: str,
    batch_size: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    lls, acc, gens = _served(server, checkpoint, tasks, [task], monkeypatch, batch_size)
    ref_lls, ref_acc, ref_gens = reference
    if task == "inferflow_mc":  # loglikelihoods: echo + logprobs over the prompt tokens
        assert len(lls) == 16 and all(len(item) == 4 for item in lls)
        for got, want in zip(lls, ref_lls, strict=True):
            assert got == pytest.approx(want, abs=1e-3)
        assert acc == ref_acc
    else:  # greedy generations
        assert len(gens) == 8 and any(gens)
        assert gens == ref_gens
