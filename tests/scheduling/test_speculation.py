"""The scheduler's side of speculative decoding: budgets, blocks, rollback, limits."""

from __future__ import annotations

from fake_executor import next_token
from sched_factories import VOCAB, Harness, OracleProposer, expected, make_config, make_request

from inferflow.runtimes.step_inputs import EngineRow, split_padding
from inferflow.scheduling.kv_cache_manager import KVCacheManager
from inferflow.scheduling.speculation import DraftRequest


def test_drafts_leave_every_later_decode_its_token() -> None:
    """A tight budget (8 tokens for 4 decoding rows): drafts take only what is left once every
    decode has its one token, so all four rows run every step."""
    cfg = make_config(max_num_batched_tokens=8, max_num_seqs=4)
    h = Harness(cfg, OracleProposer(4, error_rate=0.0))
    reqs = [make_request(f"r{i}", [1 + i, 2], max_tokens=16, ignore_eos=True) for i in range(4)]
    h.add(*reqs)
    h.run()
    assert h.outputs() == {r.request_id: expected(r, cfg) for r in reqs}
    plans, done = h.executor.plans, set()
    assert len(plans[0].chunks) == 4  # the four prompts in one step, then decodes only
    for plan, updates in zip(plans, h.updates, strict=True):
        assert {c.request_id for c in plan.chunks} == {r.request_id for r in reqs} - done
        assert plan.num_batched_tokens <= 8
        done |= {u.request_id for u in updates if u.finished}
    assert any(c.draft_token_ids for p in plans if len(p.chunks) == 4 for c in p.chunks)
    assert h.scheduler.spec_stats.num_accepted_tokens > 0


def test_drafts_are_clipped_to_max_tokens_and_rolled_back() -> None:
    cfg = make_config()
    proposer = OracleProposer(4, error_rate=0.5)
    h = Harness(cfg, proposer)
    r = make_request("a", [5, 6, 7], max_tokens=6, ignore_eos=True)
    h.add(r)
    h.run()
    assert r.output_token_ids == expected(r, cfg) and len(r.output_token_ids) == 6
    for plan in h.executor.plans:
        for c in plan.chunks:
            # drafts + the token after them never pass max_tokens
            assert c.num_output_tokens + len(c.draft_token_ids) + 1 <= 6
    assert "a" in proposer.forgotten  # the proposer heard that it finished
    stats = h.scheduler.spec_stats
    assert stats.num_drafts == len([c for p in h.executor.plans for c in p.chunks
                                    if c.draft_token_ids])
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    cfg = make_config()
    base = make_request("x", [9, 8, 7, 6], max_tokens=12, ignore_eos=True)
    stop = expected(base, cfg)[4]  # the 5th output token becomes a stop token
    r = make_request("s", [9, 8, 7, 6], max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    h = Harness(cfg, OracleProposer(4, error_rate=0.0))
    h.add(r)
    h.run()
    assert r.output_token_ids == expected(r, cfg) and r.output_token_ids[-1] == stop
    assert r.finish_reason == "stop" and r.stop_reason == stop


def test_block_reservation_keeps_blocks_for_later_decodes() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    from inferflow.scheduling.kv_cache_manager import PrefixHit

    kv.admit("a", PrefixHit((), 0), 4, slot=0)
    assert kv.max_tokens_fitting("a") == 16 and kv.max_tokens_fitting("a", reserved=2) == 8
    assert kv.max_tokens_fitting("a", reserved=9) == 4  # never below its own blocks
    kv.grow("a", 12)
    kv.shrink("a", 5)
    assert kv.block_ids("a") == kv.block_ids("a")[:2] and kv.pool.num_free_blocks == 2
    kv.check_integrity()


def test_rows_with_drafts_stay_with_the_decodes_when_a_call_is_split() -> None:
    rows = [EngineRow(0, (1, 2, 3, 4, 5), 10, True, num_logits=5),  # a decode + 4 drafts
            EngineRow(40, (7,), 3, True),  # a plain decode far away in the slot range
            EngineRow(20, tuple(range(30)), 0, True)]  # a prefill chunk
    assert split_padding(rows, [0, 1, 2]) == [[0, 1], [2]]


def test_oracle_proposer_drafts_the_true_continuation() -> None:
    tokens = [3, 1, 4, 1, 5]
    [drafts] = OracleProposer(3, error_rate=0.0).propose([DraftRequest("r", tokens, 3)])
    seq = list(tokens)
    for d in drafts:
        assert d == next_token(seq, VOCAB)
        seq.append(d)
