"""Choose the next token of each sampled row: greedy, temperature, top-k, top-p, per-request seed.

Pure numpy over a (R, V) float32 logits matrix. Rows are independent: a request's token depends
only on its own logits, parameters and RNG, never on which other requests share the step, so
greedy and seeded outputs do not depend on batch composition. Logprobs are of the model's raw
distribution (log_softmax of the unmodified logits), as OpenAI and vLLM report them.

A row with a token bitmask (structured output) samples among its allowed tokens only; rows
without one are not touched. A row whose request asks for penalties or ``logit_bias`` (or that a
configured processor applies to) has its logits processed first (``logits_processors``); ``min_p``
filters the tempered distribution before top-k and top-p (vLLM's order).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from inferflow.sampling.bitmask import allowed_tokens
from inferflow.sampling.logits_processors import BUILTIN_PROCESSORS, LogitsProcessor
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.plan import SampledToken, TokenHistory


@dataclass(frozen=True)
class SampleRow:
    request_id: str
    params: SamplingParams
    num_output_tokens: int  # tokens generated before this one (for min_tokens)
    token_bitmask: np.ndarray | None = None  # allowed tokens (packed), structured output only
    history: TokenHistory | None = None  # prompt and output before this token (penalties)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """(V,) probabilities after temperature, ``min_p``, top-k and top-p (nucleus) filtering."""
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # (only a far-below-the-top logit can overflow: to -inf)
        x = (x - x.max()) / params.temperature  # shifted first: the top is 0, nothing above it
    if params.min_p > 0.0:
        # drop what is less likely than min_p times the top token (its own ratio: always kept)
        x = np.where(x - x.max() < np.log(params.min_p), -np.inf, x)
    if params.top_k > 0 and params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


_BLOCK = 64  # tokens per block of the two-level draw
_LOGIT_CAP = float(np.finfo(np.float64).max)  # processed logits are capped here (finite)


def _plain(row: SampleRow) -> bool:
    """Nothing to apply but the choice itself: no bitmask, no logprobs, past ``min_tokens``, no
    penalty, bias or ``min_p`` (a configured processor is checked by ``Sampler.processes``)."""
    p = row.params
    return (p.logprobs is None and row.token_bitmask is None and row.num_output_tokens >= p.min_tokens
            and not p.processes_logits)


def _plain_random(row: SampleRow, vocab: int) -> bool:
    """A plain row sampled at a temperature, without top-k or top-p."""
    p = row.params
    return not p.greedy and p.top_p >= 1.0 and (p.top_k <= 0 or p.top_k >= vocab) and _plain(row)


class Sampler:
    """Samples one token per row; keeps one RNG per request (seeded ones are reproducible).

    ``logits_processors``: processors applied after the built-in ones (a plugin's; see
    ``inferflow.sampling.logits_processors``)."""

    def __init__(self, eos_token_ids: Iterable[int] = (),
                 logits_processors: Iterable[LogitsProcessor] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.extra_processors = tuple(logits_processors)
        self._rngs: dict[str, np.random.Generator] = {}
        self._buf = np.empty((0, 0), np.float32)  # _draw's scratch

    def plain(self, row: SampleRow) -> bool:
        """Whether ``row`` takes a batched fast path: nothing to apply but the choice itself."""
        return _plain(row) and not (
            self.extra_processors and any(p.applies(row.params) for p in self.extra_processors))

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._rngs.pop(rid, None)

    def rng(self, row: SampleRow) -> np.random.Generator:
        if row.params.seed is not None:
            # a seeded request's k-th token draws from a stream keyed by (seed, k): reproducible
            # across batches, and across preemption (which re-samples nothing but drops state)
            return np.random.default_rng((row.params.seed, row.num_output_tokens))
        rng = self._rngs.get(row.request_id)
        if rng is None:
            rng = self._rngs[row.request_id] = np.random.default_rng(row.params.seed)
        return rng

    def sample(self, logits: np.ndarray, rows: Sequence[SampleRow]) -> list[SampledToken]:
        """logits (R, V) -> one SampledToken per row, in order.

        Plain rows (no bitmask, no logprobs, past ``min_tokens``) run batched: greedy ones as one
        argmax, temperature-only ones as one draw (``_draw``); every other row goes through
        ``_sample_one``. Which path a row takes depends only on its own parameters."""
        plain = [i for i, row in enumerate(rows) if row.params.greedy and self.plain(row)]
        out: list[SampledToken | None] = [None] * len(rows)
        if plain:
            for i, token in zip(plain, np.argmax(logits[plain], axis=-1).tolist(), strict=True):
                out[i] = SampledToken(token)
        drawn = [i for i, row in enumerate(rows)
                 if _plain_random(row, logits.shape[-1]) and self.plain(row)]
        if drawn:
            picked = logits if len(drawn) == len(rows) else logits[drawn]
            tokens = self._draw([rows[i] for i in drawn], picked)
            for i, token in zip(drawn, tokens, strict=True):
                out[i] = SampledToken(token)
        for i, row in enumerate(rows):
            if out[i] is None:
                out[i] = self._sample_one(logits[i], row)
        return out  # type: ignore[return-value]  # every entry is filled above

    def _scratch(self, rows: int, cols: int) -> np.ndarray:
        """A (rows, cols) float32 work buffer kept between steps (grown when a step needs more)."""
        if self._buf.shape[0] < rows or self._buf.shape[1] != cols:
            self._buf = np.empty((max(rows, self._buf.shape[0]), cols), np.float32)
        return self._buf[:rows]

    def _draw(self, rows: Sequence[SampleRow], logits: np.ndarray) -> list[int]:
        """Temperature-only rows, all at once: one inverse-CDF draw each over the unnormalised
        weights exp((x - max) / T), searched in two levels (blocks of ``_BLOCK`` tokens, then
        within the chosen block) so no (R, V) cumulative sum is built. Row-wise operations
        only: a row's token does not depend on the other rows (alone it is the same, R = 1)."""
        temps = np.array([row.params.temperature for row in rows], np.float32)[:, None]
        vocab = logits.shape[1]
        padded = -(-vocab // _BLOCK) * _BLOCK
        w = self._scratch(len(rows), padded)  # reused: fresh pages cost more than the math
        x = w[:, :vocab]
        np.divide(logits, temps, out=x)
        x -= x.max(axis=-1, keepdims=True)
        np.exp(x, out=x)
        w[:, vocab:] = 0.0  # padding weighs 0: never drawn
        blocks = w.reshape(len(rows), -1, _BLOCK)
        cum = np.cumsum(blocks.sum(axis=-1, dtype=np.float64), axis=-1)  # (R, V / _BLOCK)
        u = np.fromiter((self.rng(row).random() for row in rows), np.float64, len(rows))
        u *= cum[:, -1]
        # searchsorted(side="right") row by row, as counts: a block (or token) whose weight is 0
        # is never chosen
        b = np.minimum((cum <= u[:, None]).sum(axis=1), cum.shape[1] - 1)
        at = np.arange(len(rows))
        below = np.where(b > 0, cum[at, b - 1], 0.0)  # the weight of the blocks before b
        within = np.cumsum(blocks[at, b], axis=1, dtype=np.float64) + below[:, None]
        j = (within <= u[:, None]).sum(axis=1)
        for k in np.flatnonzero(j >= _BLOCK):  # rounding put u past the block's last weight
            j[k] = np.flatnonzero(blocks[k, b[k]])[-1]
        return (b * _BLOCK + j).tolist()

    def _sample_one(self, logits: np.ndarray, row: SampleRow) -> SampledToken:
        params = row.params
        masked = self.processed_logits(logits, row)
        if params.greedy:
            token = int(np.argmax(masked))
        else:
            token = self.draw(filtered_probs(masked, params), self.rng(row))
        return with_logprobs(token, logits, params)

    def processed_logits(self, logits: np.ndarray, row: SampleRow) -> np.ndarray:
        """What the row samples from, before temperature: ``logits`` through the processors that
        apply to it (built-in, then configured), then its masks (``masked_logits``)."""
        params = row.params
        processors = [p for p in (*BUILTIN_PROCESSORS, *self.extra_processors) if p.applies(params)]
        if not processors:
            return self.masked_logits(logits, row)
        if row.history is None:
            raise ValueError(f"{row.request_id}: a row with logits processors needs its token "
                             "history (ScheduledChunk.history)")
        x = logits.astype(np.float64)  # (a copy: the raw row stays for logprobs)
        for processor in processors:
            x = processor.apply(x, params, row.history)
        # a denormal repetition_penalty can divide a logit into +inf (then inf - inf = nan in
        # the softmax): the largest finite value instead, still the top one
        np.minimum(x, _LOGIT_CAP, out=x)
        return self.masked_logits(x, row)

    def masked_logits(self, logits: np.ndarray, row: SampleRow) -> np.ndarray:
        """``logits`` with what the row may not sample at -inf: tokens outside its bitmask, and
        EOS / stop tokens before ``min_tokens`` (unless nothing else is left)."""
        params = row.params
        masked = logits
        if row.token_bitmask is not None:
            allowed = allowed_tokens(row.token_bitmask, logits.size)
            if allowed.any():  # (a grammar in an error state allows nothing: leave it to EOS)
                masked = np.where(allowed, logits, -np.inf)
        if row.num_output_tokens < params.min_tokens:
            blocked = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < logits.size]
            unblocked = masked
            masked = masked.copy()
            masked[blocked] = -np.inf
            if not np.isfinite(masked).any():  # the grammar allows only EOS: it wins
                masked = unblocked
        return masked

    def target_probs(self, logits: np.ndarray, row: SampleRow) -> np.ndarray:
        """(V,) the distribution a random row samples from (processors, masks, temperature,
        ``min_p``, top-k, top-p)."""
        return filtered_probs(self.processed_logits(logits, row), row.params)

    def draw(self, p: np.ndarray, rng: np.random.Generator) -> int:
        """One token from probabilities ``p`` (one ``rng`` uniform): an inverse-CDF draw over the
        surviving tokens (one uniform per token keeps a seeded stream reproducible, and a
        filtered-out token can never be drawn)."""
        nz = np.flatnonzero(p)
        cdf = np.cumsum(p[nz])
        k = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        return int(nz[min(k, nz.size - 1)])


def with_logprobs(token: int, logits: np.ndarray, params: SamplingParams) -> SampledToken:
    """``token`` with its log-probability and the top ``params.logprobs`` alternatives (of the
    raw distribution) when the request asked for them."""
    if params.logprobs is None:
        return SampledToken(token)
    lp = log_softmax(logits)
    return SampledToken(token, float(lp[token]), top_logprobs(lp, params.logprobs))


def top_logprobs(lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` best (token_id, logprob) of one (V,) row of logprobs, best first."""
    if k <= 0:
        return ()
    idx = np.argpartition(-lp, k - 1)[:k]
    idx = idx[np.argsort(-lp[idx], kind="stable")]
    return tuple((int(t), float(lp[t])) for t in idx)
