"""Which measured point of ``inferflow tune`` wins (:func:`measured_winner`): the most goodput,
among the points that attain ``--slo-attainment`` (:func:`attains`), ties broken by the margin
to the SLOs."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from inferflow.experiment.tune_trial import Trial

# measured goodputs this close to the best are a tie (:func:`measured_winner`)
TIE = 0.02


def attains(trial: Trial, stage: str, attainment: float | None) -> bool:
    """``--slo-attainment`` on a measured point: the share of its completed requests that met
    every SLO (goodput / request throughput: both count over the same run) is at least
    ``attainment`` (always True without one)."""
    if attainment is None:
        return True
    result = trial.measured.get(stage, {})
    served = float(result.get("request_throughput") or 0.0)
    good = float(result.get("request_goodput") or 0.0)
    return served > 0 and good / served >= attainment - 1e-9


def measured_winner(
    measured: Sequence[Trial],
    stage: str,
    slos: Mapping[str, float],
    attainment: float | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> Trial:
    """The most goodput at ``stage``; among the points within ``TIE`` of it, the one furthest
    inside its SLOs (the smallest measured p99 / limit of its binding SLO). At a fixed request
    rate every point that meets the SLOs serves what arrives, so their goodputs tie and the
    order among them is the runs' noise; the margin is what a fresh run is likeliest to repeat.
    With ``attainment``, only the points that attain it compete while one does."""
    if attainment is not None:  # the constraint holds for measured points too
        attaining = [t for t in measured if attains(t, stage, attainment)]
        if not attaining:
            log(
                f"no measured point has {attainment:.0%} of its requests inside the SLOs "
                "(--slo-attainment): the winner is the best that misses it"
            )
        measured = attaining or measured
    best = max(t.goodput(stage) or 0.0 for t in measured)
    tied = [t for t in measured if (t.goodput(stage) or 0.0) >= (1.0 - TIE) * best]

    def pressure(trial: Trial) -> float:
        result = trial.measured[stage]
        return max((result.get(f"p99_{m}_ms") or math.inf) / limit for m, limit in slos.items())

    winner = min(tied, key=lambda t: (pressure(t), -(t.goodput(stage) or 0.0)))
    if len(tied) > 1:
        log(
            f"{len(tied)} points within {TIE:.0%} of the best goodput ({best:.3f} req/s); "
            f"the winner is the one furthest inside the SLOs: {winner.label}"
        )
    return winner
