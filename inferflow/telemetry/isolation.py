"""Failure isolation: a telemetry error is logged and swallowed, never raised into a request."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

logger = logging.getLogger("inferflow.telemetry")

P = ParamSpec("P")
R = TypeVar("R")


def log_telemetry_error(where: str, exc: BaseException) -> None:
    logger.warning(
        "telemetry error in %s (ignored): %r",
        where,
        exc,
        exc_info=logger.isEnabledFor(logging.DEBUG),
    )


def isolated(default: Any) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run the function; on ``Exception`` log it and return ``default`` instead.

    Only for telemetry code paths; ``default`` must be immutable (it is shared between calls)
    and of the function's return type.
    """

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                log_telemetry_error(fn.__qualname__, exc)
                return default

        return inner

    return wrap
