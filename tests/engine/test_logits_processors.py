"""Sampling controls: presence, frequency and repetition penalties, ``min_p``, ``logit_bias``.

Each is checked against a reference on fixed logits (transformers' logits processors, vLLM's
formula for presence/frequency), then in the engine: greedy with a penalty equals transformers'
``generate`` token for token, sampling with ``min_p`` follows the filtered distribution
(chi-square), speculative decoding gives the same output with penalties, and a plugin's
processor configured on the executor changes what is sampled. Logprobs stay raw throughout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from spec_factories import make_tiny_vocab_checkpoint

from inferflow import LLM, SamplingParams
from inferflow.models.tiny import tiny_llama_path
from inferflow.sampling.logits_processors import LogitsProcessor
from inferflow.sampling.rejection import verify_drafts
from inferflow.sampling.sampler import Sampler, SampleRow, filtered_probs, log_softmax
from inferflow.scheduling.plan import TokenHistory

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 40
LOGITS = np.random.default_rng(7).normal(0.0, 2.0, V).astype(np.float32)
PROMPT = [3, 5, 5, 9, 21]
OUTPUT = [5, 11, 11, 11, 30, 2]  # 5 in both; 3, 9, 21 only in the prompt


def row(history: TokenHistory | None = None, k: int = 0, **params: object) -> SampleRow:
    sp = SamplingParams(max_tokens=64, **params)  # type: ignore[arg-type]
    return SampleRow("r", sp, k, history=history or TokenHistory(PROMPT, OUTPUT))


def processed(**params: object) -> np.ndarray:
    return Sampler().processed_logits(LOGITS, row(**params))


def vllm_penalties(logits: np.ndarray, output: list[int], presence: float,
                   frequency: float) -> np.ndarray:
    """vLLM's formula, token by token."""
    out = logits.astype(np.float64).copy()
    for t in set(output):
        out[t] -= presence + frequency * output.count(t)
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    ids = torch.tensor([PROMPT + OUTPUT])
    want = transformers.RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.tensor(LOGITS[None]))
    np.testing.assert_allclose(processed(repetition_penalty=penalty), want[0].numpy(), rtol=1e-6)


@pytest.mark.parametrize(("presence", "frequency"), [(0.8, 0.0), (0.0, 0.5), (-0.6, 1.2)])
def test_presence_and_frequency_penalties_equal_vllms_formula(presence: float,
                                                              frequency: float) -> None:
    got = processed(presence_penalty=presence, frequency_penalty=frequency)
    np.testing.assert_allclose(got, vllm_penalties(LOGITS, OUTPUT, presence, frequency))
    # the prompt does not count: tokens only there are untouched
    np.testing.assert_array_equal(got[[3, 9, 21]], LOGITS[[3, 9, 21]])


@pytest.mark.parametrize(("min_p", "temperature"), [(0.1, 1.0), (0.3, 0.7), (0.05, 1.5)])
def test_min_p_equals_transformers_after_temperature(min_p: float, temperature: float) -> None:
    scores = torch.tensor(LOGITS[None]) / temperature
    warped = transformers.MinPLogitsWarper(min_p)(torch.tensor([PROMPT]), scores)
    want = torch.softmax(warped, dim=-1)[0].double().numpy()
    got = filtered_probs(LOGITS, SamplingParams(temperature=temperature, min_p=min_p))
    assert 1 < np.count_nonzero(want) < V  # some tokens dropped, several left
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_controls_compose_in_vllms_order() -> None:
    """bias, then the repetition penalty, then presence/frequency."""
    bias = {2: 4.0, 7: -3.0}
    got = processed(logit_bias=bias, repetition_penalty=1.5, presence_penalty=0.3,
                    frequency_penalty=0.2)
    x = LOGITS.astype(np.float64).copy()
    for t, b in bias.items():
        x[t] += b
    ids = torch.tensor([PROMPT + OUTPUT])
    x = transformers.RepetitionPenaltyLogitsProcessor(1.5)(ids, torch.tensor(x[None]))[0].numpy()
    np.testing.assert_allclose(got, vllm_penalties(x, OUTPUT, 0.3, 0.2), rtol=1e-12)


def test_logit_bias_forces_and_bans_under_greedy_with_raw_logprobs() -> None:
    sampler, lp = Sampler(), log_softmax(LOGITS)
    low, top = int(np.argmin(LOGITS)), int(np.argmax(LOGITS))
    forced = sampler.sample(LOGITS[None], [row(temperature=0.0, logit_bias={low: 100.0},
                                               logprobs=2)])[0]
    assert forced.token_id == low
    assert forced.logprob == pytest.approx(lp[low])  # the raw distribution's, not the biased one
    assert [t for t, _ in forced.top_logprobs] == list(np.argsort(-lp)[:2])
    banned = sampler.sample(LOGITS[None], [row(temperature=0.0, logit_bias={top: -100.0})])[0]
    assert banned.token_id == int(np.argsort(-LOGITS)[1])
    # sampled at a temperature: a -100 bias is never drawn, a +100 one always
    rows = [row(temperature=1.0, seed=s, logit_bias={top: -100.0}) for s in range(200)]
    assert top not in {t.token_id for t in sampler.sample(np.tile(LOGITS, (200, 1)), rows)}


def test_an_extreme_repetition_penalty_stays_finite() -> None:
    """A penalty of 1e-30 multiplies a positive logit by 1e30, one of 1e-320 overflows it:
    never inf or nan in what is sampled; the repeated token with the best positive logit wins."""
    logits = LOGITS.copy()
    seen = [5, 11, 30]  # in the history, with positive logits; 11 the best
    logits[seen] = [1.0, 2.0, 1.5]
    sampler = Sampler()
    for penalty in (1e-30, 1e-320):
        for temperature in (0.0, 0.01, 0.5):
            r = row(temperature=temperature, seed=1, repetition_penalty=penalty)
            assert np.isfinite(sampler.processed_logits(logits, r)).all()
            token = sampler.sample(logits[None], [r])[0].token_id
            assert token == 11 if penalty == 1e-30 else token in seen


def test_a_plain_row_beside_a_processed_one_is_unchanged() -> None:
    logits = np.tile(LOGITS, (2, 1))
    plain, biased = SampleRow("a", SamplingParams(temperature=0.0), 0), row(
        temperature=0.0, logit_bias={0: 100.0})
    tokens = [t.token_id for t in Sampler().sample(logits, [plain, biased])]
    assert tokens == [int(np.argmax(LOGITS)), 0]


def test_greedy_verification_sees_the_accepted_drafts_in_the_history() -> None:
    """Each position is processed with the drafts accepted before it: verification emits what
    sampling one token at a time would (a frequency penalty on a repeated token)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 0.3, (4, V)).astype(np.float32)
    logits[:, 17] += 2.0  # 17 is everyone's argmax until it is penalised
    params = {"temperature": 0.0, "frequency_penalty": 0.9}
    sampler, history = Sampler(), TokenHistory(PROMPT, [17])
    want: list[int] = []
    for j in range(4):
        h = TokenHistory(PROMPT, [17, *want])
        want.append(sampler.sample(logits[j:j + 1], [row(h, 1 + j, **params)])[0].token_id)
    drafts = tuple(want[:3])
    got = [t.token_id for t in verify_drafts(sampler, logits, row(history, 1, **params), drafts)]
    assert got == want and want.count(17) < 4  # the penalty moved the argmax on the way
    wrong = (17, 17, 17)  # what an unpenalised target would accept
    got = [t.token_id for t in verify_drafts(sampler, logits, row(history, 1, **params), wrong)]
    first_miss = next(j for j in range(3) if wrong[j] != want[j])
    assert got == want[:first_miss + 1]


@pytest.mark.slow  # a sampled histogram
def test_rejection_sampling_keeps_the_processed_distribution() -> None:
    """Random verification with penalties: the first token is distributed as the processed p0,
    and after an accepted first draft the second as p1 processed with that draft counted."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.0, (3, 5)).astype(np.float32)
    params = {"temperature": 1.0, "presence_penalty": 1.5, "min_p": 0.05}
    hist = TokenHistory([0, 1], [2])
    sampler = Sampler()
    p0 = sampler.target_probs(logits[0], row(hist, 1, **params))
    drafts = (int(np.argmax(p0)), 1)
    p1 = sampler.target_probs(logits[1], row(hist._replace(accepted=drafts[:1]), 2, **params))
    assert not np.allclose(p1, sampler.target_probs(logits[1], row(hist, 2, **params)))
    n, first, second = 30_000, np.zeros(5), np.zeros(5)
    for _ in range(n):
        out = verify_drafts(sampler, logits, row(hist, 1, **params), drafts)
        first[out[0].token_id] += 1
        if out[0].token_id == drafts[0]:
            second[out[1].token_id] += 1
    assert np.abs(first / n - p0).max() < 0.012
    assert np.abs(second / second.sum() - p1).max() < 0.015


class BanToken:
    """A plugin's processor: token ``token`` is never sampled (every row)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def applies(self, params: SamplingParams) -> bool:
        return True

    def apply(self, logits: np.ndarray, params: SamplingParams,
              history: TokenHistory) -> np.ndarray:
        logits[self.token] = -np.inf
        return logits


def test_a_configured_processor_runs_after_the_built_in_ones() -> None:
    assert isinstance(BanToken(0), LogitsProcessor)
    top = int(np.argmax(LOGITS))
    sampler = Sampler(logits_processors=[BanToken(top)])
    plain = SampleRow("a", SamplingParams(temperature=0.0), 0, history=TokenHistory([1], []))
    assert not sampler.plain(plain)
    # the plugin bans what the bias would force
    forced = row(temperature=0.0, logit_bias={top: 100.0})
    assert [t.token_id for t in sampler.sample(np.tile(LOGITS, (2, 1)), [plain, forced])] == [
        int(np.argsort(-LOGITS)[1])] * 2


# -- in the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    """The trained default: it repeats itself, so penalties change its greedy output."""
    return tiny_llama_path()


class VllmPenalties:
    """transformers ``LogitsProcessor`` applying vLLM's presence/frequency formula to the
    generated tokens (those after the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[0, self.prompt_len:].tolist()
        out = scores.clone()
        for t in set(output):
            out[0, t] -= self.presence + self.frequency * output.count(t)
        return out


@pytest.mark.parametrize("controls", [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.8, "frequency_penalty": 0.6},
])
def test_greedy_with_penalties_equals_transformers_generate(checkpoint: Path,
                                                            controls: dict[str, float]) -> None:
    llm = LLM(checkpoint, max_slots=2, max_model_len=128, generation_config="none")
    prompt = llm.tokenizer.encode("The list, the list, the list, the list")
    n = 24
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([prompt])
    extra: dict[str, object] = {}
    if "repetition_penalty" in controls:
        extra["repetition_penalty"] = controls["repetition_penalty"]
    else:
        extra["logits_processor"] = transformers.LogitsProcessorList([VllmPenalties(
            len(prompt), controls["presence_penalty"], controls["frequency_penalty"])])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert want != plain[0, len(prompt):].tolist()  # the penalty changed the greedy output
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0,
                            **controls)  # type: ignore[arg-type]
    got = llm.generate(prompt, params)[0].outputs[0]
    assert list(got.token_ids) == want
    # logprobs are the raw model's: a penalised token's logprob is its unpenalised one
    raw = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    reported = [lp.logprob for lp in got.logprobs]
    np.testing.assert_allclose(reported, raw[torch.arange(n), want].detach().numpy(), atol=2e-4)


def test_logit_bias_past_the_vocabulary_is_refused_naming_it(checkpoint: Path) -> None:
    from inferflow.engine.llm_engine import RequestRejected

    llm = LLM(checkpoint, max_slots=1, max_model_len=64)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestRejected, match=f"in \\[0, {vocab}\\)") as info:
        llm.engine.add_request("x", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert info.value.field == "logit_bias"


def test_speculative_decoding_keeps_the_penalised_greedy_output() -> None:
    """n-gram drafts on repetitive prompts, greedy with a frequency penalty: the same tokens as
    without drafts (each draft verified with the drafts before it counted), and drafts were
    accepted, so the history within a step mattered."""
    prompts = ["The list, the list, the list, the list",
               "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return",
               ".. function:: open(file, mode='r')\n\n   Open *file* and return a file object.\n\n"
               ".. function:: open("]
    kw: dict[str, object] = {"max_slots": 3, "max_num_seqs": 3, "max_model_len": 256}
    plain = LLM(tiny_llama_path(), **kw)
    spec = LLM(tiny_llama_path(), speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}, **kw)
    unpenalised = [o.outputs[0].token_ids
                   for o in plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))]
    for controls in ({"frequency_penalty": 0.1}, {"presence_penalty": 0.2},
                     {"repetition_penalty": 1.05}):
        params = SamplingParams(temperature=0.0, max_tokens=64, **controls)  # type: ignore[arg-type]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        accepted = spec.engine.scheduler.spec_stats.num_accepted_tokens
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
        assert got == want != unpenalised, controls
        assert spec.engine.scheduler.spec_stats.num_accepted_tokens > accepted + 20, controls


@pytest.mark.slow  # 3,000 seeded samples
def test_min_p_sampling_follows_the_filtered_distribution(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """3,000 seeded first tokens of an 8-token model at temperature 1 with ``min_p``: tokens
    below the cut never appear, the rest follow transformers' ``MinPLogitsWarper`` distribution
    (chi-square goodness of fit, p > 0.001; fixed seeds, so deterministic). The reference
    logits are the engine's raw logprobs (all 8), which must equal transformers' too."""
    from scipy.stats import chisquare

    path = make_tiny_vocab_checkpoint(tmp_path_factory.mktemp("vocab8") / "ckpt")
    prompt = [0, 2, 3, 5, 2]
    llm = LLM(path, max_slots=64, max_num_seqs=64, max_model_len=64)
    probe = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=8))
    raw = np.full(8, -np.inf)
    for t, lp in probe[0].outputs[0].logprobs[0].top:
        raw[t] = lp
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want_raw = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1).numpy()
    np.testing.assert_allclose(raw, want_raw, atol=1e-4)
    probs = np.sort(np.exp(raw))[::-1]
    min_p = float(probs[3] / probs[0] + probs[2] / probs[0]) / 2  # keeps exactly 3 tokens
    warped = transformers.MinPLogitsWarper(min_p)(torch.tensor([prompt]), torch.tensor(raw[None]))
    expected = torch.softmax(warped, -1)[0].double().numpy()
    assert np.count_nonzero(expected) == 3
    n = 3000
    params = [SamplingParams(temperature=1.0, min_p=min_p, max_tokens=1, ignore_eos=True, seed=i,
                             logprobs=0) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    tokens = np.array([o.outputs[0].token_ids[0] for o in outs])
    assert all(o.outputs[0].logprobs[0].logprob == pytest.approx(raw[t], abs=1e-4)
               for o, t in zip(outs[:50], tokens[:50], strict=True))  # raw logprobs
    counts = np.bincount(tokens, minlength=8)
    kept = expected > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept], expected[kept] * n).pvalue > 1e-3, (counts, expected)


def test_a_plugin_processor_on_the_executor_config_changes_the_output(checkpoint: Path) -> None:
    """``executor.logits_processors`` (allowlisted ``_target_`` nodes) reaches the sampler of a
    composed engine: banning the greedy output's first token changes it, every row alike."""
    from inferflow.compose import compose_config
    from inferflow.graph import build_graph

    llm = LLM(checkpoint, max_slots=1, max_model_len=64)
    prompt = llm.tokenizer.encode("The list, the list")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    banned = llm.generate(prompt, greedy)[0].outputs[0].token_ids[0]
    node = f"{{_target_:{BanToken.__module__}.BanToken,token:{banned}}}"
    cfg = compose_config(["model=local", f"model.path={checkpoint}", "executor.max_slots=1",
                          "model.max_model_len=64", f"allowed_targets=[{BanToken.__module__}]",
                          f"executor.logits_processors=[{node}]"])
    engine = build_graph(cfg).create_engine()
    assert engine.executor.settings()["logits_processors"] == [f"{BanToken.__module__}.BanToken"]
    engine.add_request("r", prompt, greedy)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == 6 and banned not in tokens
