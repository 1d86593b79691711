"""``inferflow tune``'s fast model of the served engine: step-time profiles timed on this machine
(one per distinct executor setting), calibrated on one served run of the default config, and
predictions by replaying the workload on the real scheduler (:mod:`~inferflow.experiment.simulate`).

:class:`EngineModel` is what :class:`~inferflow.experiment.tune.Tuner` ranks candidates with
before it measures any; :func:`check_point` composes and checks one point as ``task=check``
would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from inferflow.config import ConfigError
from inferflow.experiment.simulate import CostModel, Profile, Workload, profile_engine, simulate
from inferflow.experiment.space import Point, SearchSpace, format_value

# the step-time scales calibration may find, and its bisection steps (2 ** -12 of the log range)
CALIBRATION_SCALES = (0.25, 4.0)
CALIBRATION_STEPS = 12

# (graph, layout, "") for a point the graph accepts, else (None, None, the reason in one line)
Checked = tuple[Any, Any, str]


def check_point(overrides: Sequence[str]) -> Checked:
    """Compose ``overrides`` and check the engine settings as ``task=check`` does."""
    from inferflow.compose import compose_config
    from inferflow.graph import build_graph

    try:
        graph = build_graph(compose_config(list(overrides)))
        return graph, graph.check_engine_settings(), ""
    except Exception as exc:  # ConfigError, Hydra's, a stage's ValueError
        from inferflow.cli import describe_hydra_error

        text = str(exc) if isinstance(exc, ConfigError) else describe_hydra_error(exc)
        return None, None, text.splitlines()[0] if text else repr(exc)


def decode_span_ms(figures: Mapping[str, Any]) -> float | None:
    """Mean E2EL - mean TTFT of a run's figures (ms): a request's time after its first token."""
    e2el, ttft = figures.get("mean_e2el_ms"), figures.get("mean_ttft_ms")
    if e2el is None or ttft is None or float(e2el) <= float(ttft):
        return None
    return float(e2el) - float(ttft)


class EngineModel:
    """Predicted figures of a point of ``space`` for ``workload`` under ``slos`` (module doc).

    ``check`` composes a point's overrides (the tuner's cached :func:`check_point`); profiles are
    timed on demand, at most ``max_profiles``, and their wall time is :attr:`profile_s`
    (measurement time, like a served run's)."""

    def __init__(
        self,
        base: Any,
        space: SearchSpace,
        workload: Mapping[str, Any],
        slos: Mapping[str, float],
        check: Callable[[Sequence[str]], Checked],
        *,
        base_overrides: Sequence[str] = (),
        max_profiles: int = 2,
        log: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.base = base
        self.space = space
        self.workload = workload
        self.slos = slos
        self.check = check
        self.base_overrides = list(base_overrides)
        self.max_profiles = max_profiles
        self.log = log
        self.profiles: dict[tuple[str, ...], Profile] = {}
        # executor settings predicted with the base's profile (theirs not timed), logged once
        self.borrowed: set[tuple[str, ...]] = set()
        self.profile_s = 0.0
        # calibration: every step time x scale, and overhead_s added to each request's TTFT
        self.scale, self.overhead_s = 1.0, 0.0

    def executor_key(self, point: Mapping[str, Any]) -> tuple[str, ...]:
        """The executor settings of ``point`` that differ from the base's (one step-time model
        each; the base's own values share the base's)."""
        from omegaconf import OmegaConf

        return tuple(
            sorted(
                f"{k}={format_value(v)}"
                for k, v in point.items()
                if k.startswith("executor.")
                and format_value(v) != format_value(OmegaConf.select(self.base, k, default=None))
            )
        )

    def max_rows(self) -> int:
        """The largest batch a profile times: the space's largest ``max_num_seqs`` (or the
        base's), capped by the workload's concurrency and 64."""
        seqs = [int(self.base.batching.max_num_seqs)] if self.base.get("batching") else [1]
        for knob in self.space.knobs:
            if knob.key == "batching.max_num_seqs":
                seqs = [int(v) for v in knob.values(256)]
        cap = self.workload.get("max_concurrency") or int(self.workload["num_prompts"])
        return max(1, min(max(seqs), int(cap), 64))

    def profile(self, key: tuple[str, ...]) -> Profile | None:
        """The step-time model of executor setting ``key`` (timed here once; None once
        ``max_profiles`` are spent or when the engine does not start)."""
        if key in self.profiles:
            return self.profiles[key]
        if len(self.profiles) >= self.max_profiles:
            return None
        rows = self.max_rows()
        tokens = max(
            rows,
            int(self.base.batching.max_num_batched_tokens) if self.base.get("batching") else rows,
        )
        sized = [*key, f"batching.max_num_seqs={rows}", f"batching.max_num_batched_tokens={tokens}"]
        # not through ``check``'s cache: the engine loaded here goes with this graph
        graph, _, reason = check_point([*self.base_overrides, *sized])
        if graph is None:
            self.log(f"profile {' '.join(key) or 'base'}: {reason}")
            return None
        self.log(f"timing engine steps ({' '.join(key) or 'base executor'}; up to {rows} rows)")
        started = time.perf_counter()
        try:
            prof = profile_engine(graph, input_len=int(self.workload["input_len"]), max_rows=rows)
        except Exception as exc:  # (an engine that does not load: its points are infeasible)
            self.log(f"profile {' '.join(key) or 'base'} failed: {exc}".splitlines()[0])
            prof = Profile(CostModel((math.inf, 0, 0, 0)), seconds=time.perf_counter() - started)
        finally:
            del graph
        self.profile_s += prof.seconds
        self.profiles[key] = prof
        if not math.isinf(prof.cost.coef[0]):
            c = prof.cost.coef
            self.log(
                f"step model: {1000 * c[0]:.2f} ms + {1000 * c[1]:.3f} ms/row + "
                f"{1000 * c[2]:.4f} ms/token + {1000 * c[3]:.3f} ms/1k context "
                f"({prof.cost.samples} steps, rmse {1000 * prof.cost.rmse_s:.2f} ms, "
                f"{prof.seconds:.0f} s)"
            )
        return prof

    def predict(
        self,
        point: Point,
        overrides: Sequence[str],
        workload: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Any], str]:
        """(predicted figures, "") or ({}, why not), for ``workload`` (default: the tuned one)."""
        graph, layout, reason = self.check(overrides)
        if graph is None:
            return {}, reason
        key = self.executor_key(point)
        prof, used = self.profile(key), key
        if prof is None and key:  # its own profile not timed: --max-profiles spent
            prof, used = self.profile(()), ()
            if key not in self.borrowed:
                self.borrowed.add(key)
                self.log(
                    f"no step profile for {' '.join(key)} (--max-profiles {self.max_profiles} "
                    "spent): its points are predicted with the base executor's step times"
                )
        if prof is None or math.isinf(prof.cost.coef[0]):
            return {}, "the engine did not start for its step profile"
        figures = simulate(
            graph,
            Workload.of(self.workload if workload is None else workload),
            prof.cost.scaled(self.scale),
            self.slos,
            overhead_s=self.overhead_s,
            layout=layout,
        )
        figures["step_profile"] = " ".join(used) or "base"  # (trials.csv: which one ranked it)
        return figures, ""

    def calibrate(self, measured: Mapping[str, Any], workload: Mapping[str, Any]) -> None:
        """Fit the model to the default's run of ``workload`` (replayed with the same number of
        prompts and the same arrivals, so both see the same queue): the step-time scale whose
        replay has the run's mean decode span (E2EL - TTFT: the steps a request spends after its
        first token, free of any per-request overhead; TPOT is no guide where the server streams
        several tokens per chunk), then a per-request overhead from the median TTFT.

        The span grows with the scale, not always in proportion (the batches change with it), so
        the scale is found by bisection in log space within ``CALIBRATION_SCALES``."""
        if not self.predict({}, [], workload)[0]:
            return
        real_span = decode_span_ms(measured)
        if real_span is not None:
            lo, hi = CALIBRATION_SCALES
            for _ in range(CALIBRATION_STEPS):
                self.scale = math.sqrt(lo * hi)
                sim_span = decode_span_ms(self.predict({}, [], workload)[0]) or 0.0
                lo, hi = (self.scale, hi) if sim_span < real_span else (lo, self.scale)
            self.scale = math.sqrt(lo * hi)
        predicted, _ = self.predict({}, [], workload)
        sim_ttft, real_ttft = predicted.get("median_ttft_ms"), measured.get("median_ttft_ms")
        if sim_ttft is not None and real_ttft is not None:
            self.overhead_s = min(1.0, max(0.0, (float(real_ttft) - float(sim_ttft)) / 1000))
        self.log(
            f"model calibrated on the default's run: step times x{self.scale:.2f}, "
            f"+{1000 * self.overhead_s:.0f} ms per request"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report's ``engine_model`` (each profile) and ``calibration``."""
        return {
            "engine_model": {" ".join(k) or "base": p.to_dict() for k, p in self.profiles.items()},
            "calibration": {"step_scale": self.scale, "overhead_ms": 1000 * self.overhead_s},
        }
