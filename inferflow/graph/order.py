"""Where each stage of the serving graph runs: the request path's order (``splice_order``) and
which side of the engine a stage sits on (``place_stages``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferflow.config.base import ConfigError
from inferflow.config.schema import ENGINE_SLOTS
from inferflow.stages.base import RequestStage
from inferflow.stages.engine_slot import EngineStage
from inferflow.stages.response import ResponseStage


def splice_order(pipeline: list[str], stages: Mapping[str, Any]) -> list[str]:
    """Names in request order: the pipeline's slots with each extra stage placed ``after:`` or
    ``before:`` its anchor (a slot or another extra stage); stages sharing an anchor keep their
    declaration order."""
    order = list(pipeline)
    last_after: dict[str, str] = {}
    pending = dict(stages)
    while pending:
        placed = []
        for name, node in pending.items():
            after, before = node.get("after"), node.get("before")
            if (after is None) == (before is None):
                raise ConfigError(
                    f"stages.{name}: set exactly one of after: or before: (a slot or stage name)"
                )
            anchor = after if after is not None else before
            if anchor not in order:
                continue
            if after is not None:
                order.insert(order.index(last_after.get(anchor, anchor)) + 1, name)
                last_after[anchor] = name
            else:
                order.insert(order.index(anchor), name)
            placed.append(name)
        if not placed:
            name, node = next(iter(pending.items()))
            anchor = node.get("after", node.get("before"))
            raise ConfigError(
                f"stages.{name}: anchor {anchor!r} is not in the pipeline; known: {', '.join(order)}",
                f"stages.{name}",
            )
        for name in placed:
            del pending[name]
    return order


def place_stages(
    order: list[str], built: Mapping[str, Any]
) -> tuple[list[RequestStage], list[ResponseStage]]:
    """Request stages (before the engine) and response stages (after it), in pipeline order.

    The engine spans the engine-side slots; a request stage placed after the last of them, or a
    response stage placed before it, would not run where its config says: both are errors.
    """
    engine_end = max(i for i, name in enumerate(order) if name in ENGINE_SLOTS)
    request_stages: list[RequestStage] = []
    response_stages: list[ResponseStage] = []
    for i, name in enumerate(order):
        item = built.get(name)
        if isinstance(item, EngineStage):
            request_stages.extend(item.request_stages())
        elif isinstance(item, ResponseStage):
            if i < engine_end:
                raise ConfigError(
                    f"stages.{name}: a ResponseStage runs on the engine's output; place it "
                    f"after: {order[engine_end]} (or after another response stage)",
                    f"stages.{name}",
                )
            response_stages.append(item)
        elif isinstance(item, RequestStage):
            if i > engine_end:
                raise ConfigError(
                    f"stages.{name}: a RequestStage runs before the engine; place it before: "
                    f"{order[engine_end]} (or make it a ResponseStage to act on the output)",
                    f"stages.{name}",
                )
            request_stages.append(item)
    return request_stages, response_stages
