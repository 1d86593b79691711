"""A server whose KV budget cannot hold the full context serves the context that fits, says so
in its start-up log and in ``/v1/models``, and refuses longer prompts with a 400."""

from __future__ import annotations

import pytest
from server_harness import MODEL, start_server

from inferflow.runtimes.ort_ops.build import op_status

needs_op = pytest.mark.skipif(not op_status()[0], reason=f"paged-attention op: {op_status()[1]}")

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.mark.parametrize(
    ("overrides", "served", "message"),
    [
        # slots: 32 MiB / 4 KiB per token / (16 slots + an equal pool)
        (["executor.graph_form=gqa", "executor.kv_cache_memory=32MiB"], 256,
         "does not fit the KV budget"),
        # ONNX Runtime's paged pool: 1 MiB = 256 tokens, the whole pool one sequence's most
        pytest.param(["executor.graph_form=paged", "executor.kv_cache_memory=1MiB"], 256,
                     "more than the whole paged KV pool", marks=needs_op),
    ],
    ids=["slots", "paged"],
)
def test_the_served_context_is_what_the_kv_budget_holds(
    tmp_path_factory: pytest.TempPathFactory, overrides: list[str], served: int, message: str
) -> None:
    srv = start_server(tmp_path_factory, "kv-budget", [*overrides, "batching.max_num_seqs=16"])
    try:
        card = srv.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == served
        assert message in srv.log()
        out = srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        long = srv.post(
            "/v1/completions", json={"model": MODEL, "prompt": [5] * 300, "max_tokens": 4}
        )
        assert long.status_code == 400, long.text
        assert long.json()["error"]["code"] == "context_length_exceeded"
        engine = srv.get("/version").json()["engine"]
        assert engine["layout"]["max_model_len"] == served
    finally:
        srv.terminate()
