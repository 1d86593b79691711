"""``inferflow traces FILE``: text waterfalls of the requests in an OTLP-JSON lines trace file,
their queue/compute breakdown, and percentiles per span name over all requests.

Also ``python -m inferflow.telemetry.trace_viewer FILE``. Exit codes: 0 ok, 1 unreadable or
empty trace file, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from inferflow.telemetry import attributes as A
from inferflow.telemetry.trace_model import (
    RequestBreakdown,
    SpanRecord,
    durations_by_name,
    group_by_trace,
    is_request_trace,
    load_spans,
    percentile,
    request_breakdown,
    tree_rows,
)

NAME_WIDTH = 34


def _ms(seconds: float) -> str:
    return f"{seconds * 1000.0:9.3f}"


def _bar(start: float, dur: float, total: float, width: int, full: str) -> str:
    """Cells ``[start, start+dur)`` of a ``width``-cell row spanning ``total`` seconds."""
    if total <= 0:
        return " " * width
    lo = min(width - 1, int(start / total * width))
    hi = max(lo + 1, min(width, round((start + dur) / total * width)))
    return " " * lo + full * (hi - lo) + " " * (width - hi)


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:5.1f}%" if whole > 0 else "    -"


def breakdown_line(b: RequestBreakdown) -> str:
    return (
        f"  queue {b.queue * 1e3:.3f} ms ({_pct(b.queue, b.e2e)}) | "
        f"compute {b.compute * 1e3:.3f} ms ({_pct(b.compute, b.e2e)}: "
        f"prefill {b.prefill * 1e3:.3f}, decode {b.decode * 1e3:.3f}) | "
        f"other {b.other * 1e3:.3f} ms ({_pct(b.other, b.e2e)})"
    )


def render_waterfall(trace_spans: Sequence[SpanRecord], width: int = 40, full: str = "█") -> str:
    """One request: header, queue/compute breakdown, and a row per span indented by depth with a
    bar scaled to the request's whole duration."""
    b = request_breakdown(trace_spans)
    t0 = min(s.start_ns for s in trace_spans)
    total = (max(s.end_ns for s in trace_spans) - t0) / 1e9
    rows = tree_rows(trace_spans)
    rid = f"  request_id={b.request_id}" if b.request_id else ""
    lines = [
        f"trace {b.trace_id}  {b.name}{rid}  e2e {b.e2e * 1e3:.3f} ms{'  FAILED' if b.failed else ''}",
        breakdown_line(b),
        f"  {'span':<{NAME_WIDTH}} start(ms)   dur(ms)  |{f'0 .. {total * 1e3:.3f} ms':<{width}}|",
    ]
    for depth, span in rows:
        start, dur = (span.start_ns - t0) / 1e9, span.duration_s
        name = ("  " * depth + span.name)[:NAME_WIDTH]
        bar = _bar(start, dur, total, width, full)
        lines.append(f"  {name:<{NAME_WIDTH}}{_ms(start)} {_ms(dur)}  |{bar}|")
    return "\n".join(lines)


def render_summary(
    request_traces: Sequence[Sequence[SpanRecord]], step_spans: Sequence[SpanRecord]
) -> str:
    """Percentiles (ms) per span name over all requests, plus e2e/other and engine steps."""
    breakdowns = [request_breakdown(t) for t in request_traces]
    # rows in tree order (root, stages, llm_request, queue, compute, ...), durations per name
    series = durations_by_name(span for t in request_traces for _, span in tree_rows(t))
    series = {"e2e": [b.e2e for b in breakdowns], **series, "other": [b.other for b in breakdowns]}
    if step_spans:
        series[A.SPAN_ENGINE_STEP] = [s.duration_s for s in step_spans]
    lines = [
        f"summary: {len(breakdowns)} requests, {len(step_spans)} engine steps (times in ms)",
        f"  {'span':<{NAME_WIDTH}}{'count':>7}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
    ]
    for name, values in series.items():
        if not values:
            continue
        stats = [percentile(values, q) for q in (50, 90, 99)] + [sum(values) / len(values)]
        cells = "".join(f"{v * 1e3:10.3f}" for v in stats)
        lines.append(f"  {name[:NAME_WIDTH]:<{NAME_WIDTH}}{len(values):>7}{cells}")
    if step_spans:
        sizes = [float(s.attributes.get(A.STEP_BATCH_SIZE, 0)) for s in step_spans]
        quantiles = ", ".join(f"p{q} {percentile(sizes, q):.1f}" for q in (50, 90, 99))
        lines.append(f"  engine step batch size: {quantiles}, mean {sum(sizes) / len(sizes):.2f}")
    e2e = sum(b.e2e for b in breakdowns)
    if e2e > 0:
        queue, compute = sum(b.queue for b in breakdowns), sum(b.compute for b in breakdowns)
        lines.append(
            f"  share of e2e: queue {_pct(queue, e2e)}, compute {_pct(compute, e2e)}, "
            f"other {_pct(max(0.0, e2e - queue - compute), e2e)}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferflow traces", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="OTLP-JSON lines trace file(s)")
    p.add_argument(
        "--limit", type=int, default=10, help="waterfalls to print (0 = all; default 10)"
    )
    p.add_argument("--trace-id", help="only this trace (hex id)")
    p.add_argument("--request-id", help="only the request with this inferflow.request.id")
    p.add_argument(
        "--model",
        help="only requests served by this model (the inferflow.model.name resource attribute):"
        " one trace file holds every model a server serves",
    )
    p.add_argument("--summary-only", action="store_true", help="skip the waterfalls")
    p.add_argument("--width", type=int, default=40, help="waterfall bar width in characters")
    p.add_argument("--ascii", action="store_true", help="draw bars with '#'")
    return p


def _can_encode(out: TextIO, text: str) -> bool:
    try:
        text.encode(getattr(out, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _select(traces: list[list[SpanRecord]], args: argparse.Namespace) -> list[list[SpanRecord]]:
    if args.trace_id:
        traces = [t for t in traces if t[0].trace_id == args.trace_id.lower()]
    if args.request_id:
        traces = [
            t for t in traces if any(s.attributes.get(A.REQUEST_ID) == args.request_id for s in t)
        ]
    if args.model:
        traces = [t for t in traces if _model_of(t) == args.model]
    return traces


def _model_of(trace: list[SpanRecord]) -> str | None:
    """The model a request trace served: its root's ``gen_ai.request.model`` (an embedding
    request in a multi-model server), else the process resource's model name."""
    named = [s.attributes.get(A.GEN_AI_REQUEST_MODEL) for s in trace]
    named += [s.resource.get(A.RESOURCE_MODEL_NAME) for s in trace]
    return next((model for model in named if isinstance(model, str)), None)


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of ``inferflow traces``; returns the exit code."""
    args = _parser().parse_args(argv)
    out = out or sys.stdout
    if args.width < 10:
        print("inferflow traces: --width must be >= 10", file=sys.stderr)
        return 2
    try:
        spans = load_spans(args.files)
    except (OSError, ValueError) as exc:
        print(f"inferflow traces: {exc}", file=sys.stderr)
        return 1
    if not spans:
        print(f"inferflow traces: no spans in {', '.join(args.files)}", file=sys.stderr)
        return 1
    traces = sorted(group_by_trace(spans).values(), key=lambda t: min(s.start_ns for s in t))
    requests = [t for t in traces if is_request_trace(t)]
    steps = [
        s for t in traces if not is_request_trace(t) for s in t if s.name == A.SPAN_ENGINE_STEP
    ]
    shown = _select(requests, args)
    full = "#" if args.ascii or not _can_encode(out, "█") else "█"
    if not args.summary_only:
        limit = len(shown) if args.limit <= 0 else args.limit
        for t in shown[:limit]:
            print(render_waterfall(t, args.width, full), end="\n\n", file=out)
        if len(shown) > limit:
            print(f"... {len(shown) - limit} more requests (--limit 0 shows all)\n", file=out)
    print(render_summary(shown, steps), file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
