"""Every engine-side knob: the value ``--cfg job`` prints is the value the running engine uses
(read back from a live server's ``/version`` and ``/admin/stats``), and cache=none / ~cache
really turn prefix caching off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cfg_helpers import run_cli
from server_harness import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

# Non-default values for every engine-side knob (executor.cache_dir is left to the test env).
KNOBS = [
    "model.max_model_len=512",
    "batching.max_num_seqs=3",
    "batching.max_num_batched_tokens=96",
    "batching.enable_chunked_prefill=true",
    "batching.long_prefill_token_threshold=32",
    "batching.policy=priority",
    "cache=none",
    "cache.block_size=8",
    "cache.num_blocks=300",
    "executor.max_slots=4",
    "executor.precision=int8",
    "executor.graph_form=gqa",
    "executor.intra_op_threads=1",
    "executor.inter_op_threads=1",
    "executor.allow_spinning=false",
    "executor.quant_block_size=16",
    "executor.quant_accuracy_level=0",
    "detokenizer.stream_interval=2",
    "detokenizer.skip_special_tokens=false",
]

# --cfg job key -> where the running engine reports the value it uses (in /version's "engine")
IN_EFFECT = {
    "model.max_model_len": ("layout", "max_model_len"),
    "batching.max_num_seqs": ("scheduler", "max_num_seqs"),
    "batching.max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "batching.enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "batching.long_prefill_token_threshold": ("scheduler", "long_prefill_token_threshold"),
    "batching.policy": ("scheduler", "policy"),
    "cache.block_size": ("layout", "block_size"),
    "cache.num_blocks": ("layout", "num_blocks"),
    "executor.max_slots": ("layout", "max_slots"),
    "executor.precision": ("runtime_config", "precision"),
    "executor.graph_form": ("runtime_config", "graph_form"),
    "executor.intra_op_threads": ("runtime_config", "intra_op_threads"),
    "executor.inter_op_threads": ("runtime_config", "inter_op_threads"),
    "executor.allow_spinning": ("runtime_config", "allow_spinning"),
    "executor.quant_block_size": ("runtime_config", "quant_block_size"),
    "executor.quant_accuracy_level": ("runtime_config", "quant_accuracy_level"),
    "detokenizer.stream_interval": ("detokenizer", "stream_interval"),
    "detokenizer.skip_special_tokens": ("detokenizer", "skip_special_tokens"),
}


@pytest.fixture(scope="module")
def knob_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(KNOBS, tmp_path_factory.mktemp("knobs"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.terminate()


def _lookup(cfg: dict, dotted: str) -> object:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def test_every_engine_knob_in_cfg_job_is_the_value_in_effect(
    knob_server: ServerProcess, cli_env: dict[str, str], workdir: Path
) -> None:
    printed = run_cli(["--cfg", "job", *KNOBS], cli_env, workdir)
    assert printed.returncode == 0, printed.stderr
    cfg = yaml.safe_load(printed.stdout)
    for knob in KNOBS:  # the test really changed every knob it checks
        key, value = knob.split("=")
        if key != "cache":  # a group choice, not a value
            assert str(_lookup(cfg, key)).lower() == value.lower(), knob
    assert cfg["cache"]["_target_"] == "inferflow.stages.cache.NoPrefixCache"
    engine = knob_server.get("/version").json()["engine"]
    assert set(IN_EFFECT) == {k.split("=")[0] for k in KNOBS} - {"cache"}
    for key, (section, name) in IN_EFFECT.items():
        assert engine[section][name] == _lookup(cfg, key), key
    assert engine["scheduler"]["enable_prefix_caching"] is False  # cache=none
    assert engine["scheduler"]["max_running"] == 3 == knob_server.stats()["engine"]["total_slots"]
    assert engine["backend"] == "onnxruntime" and engine["runtime_version"]


def test_stream_interval_batches_tokens_per_delta(knob_server: ServerProcess) -> None:
    chunks = knob_server.client().completions.create(
        model="tiny-llama",
        prompt="Count with me",
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, usage = [], None
    for chunk in chunks:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 9
    assert len(texts) <= 5  # 9 tokens every 2 -> 5 deltas (the last one carries one token)


def test_cache_none_reports_no_hits_live(knob_server: ServerProcess) -> None:
    prompt = [11] * 64  # 8 full blocks of 8
    usages = []
    for _ in range(2):
        out = knob_server.client().completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=1, temperature=0
        )
        usages.append(out.usage)
    details = [u.prompt_tokens_details for u in usages]
    assert all(d is None or not d.cached_tokens for d in details)
    stats = knob_server.stats()["engine"]
    assert stats["prefix_cache_hits"] == 0
