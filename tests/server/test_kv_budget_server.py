"""A server whose KV budget cannot hold the full context serves the context that fits, says so
in its start-up log and in ``/v1/models``, and refuses longer prompts with a 400."""

from __future__ import annotations

import pytest
from server_harness import MODEL, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_the_served_context_is_what_the_kv_budget_holds(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    srv = start_server(tmp_path_factory, "kv-budget",
                       ["executor.kv_cache_memory=32MiB", "batching.max_num_seqs=16"])
    try:
        card = srv.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == 256  # 32 MiB / 4 KiB per token / (16 slots + pool)
        assert "does not fit the KV budget" in srv.log()
        out = srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        long = srv.post(
            "/v1/completions", json={"model": MODEL, "prompt": [5] * 300, "max_tokens": 4}
        )
        assert long.status_code == 400, long.text
        assert long.json()["error"]["code"] == "context_length_exceeded"
        engine = srv.get("/version").json()["engine"]
        assert engine["layout"]["max_model_len"] == 256
    finally:
        srv.terminate()
