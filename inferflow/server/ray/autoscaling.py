"""Queue-depth autoscaling of the engine deployment (a Ray Serve custom autoscaling policy).

Each engine replica reports ``queue_depth`` = its engine's waiting + running requests
(``EngineReplica.record_autoscaling_stats``, every ``metrics_interval_s``). The policy wants
enough replicas for that depth, plus the requests still queued in front of the replicas (at the
handles), at ``target_per_replica`` each; Ray Serve applies the min/max bounds and the
up/down delays of the deployment's ``AutoscalingConfig`` around it.
"""

from __future__ import annotations

import math
from typing import Any

METRIC = "queue_depth"


def desired_replicas(depths: dict[Any, float], queued: float, target: float) -> int:
    """Replicas for ``depths`` (per replica) + ``queued`` requests at ``target`` each (>= 1)."""
    total = sum(depths.values()) + max(0.0, queued)
    return max(1, math.ceil(total / max(target, 1e-9)))


def queue_depth_policy(ctx: Any) -> tuple[int, dict]:
    """``AutoscalingPolicy(policy_function=...)``: (desired replicas, policy state). The target
    queue depth per replica is the deployment's ``target_ongoing_requests`` (the host sets it
    to ``autoscaling.target_per_replica``)."""
    target = ctx.config.target_ongoing_requests or 1
    depths = (ctx.aggregated_metrics or {}).get(METRIC, {})
    queued = ctx.total_queued_requests or 0.0
    if not depths:  # no report yet (replicas starting): keep the current target
        return ctx.target_num_replicas, {}
    return desired_replicas(depths, queued, float(target)), {}
