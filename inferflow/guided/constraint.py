"""Moved: ``GuidedConstraint``, ``GuidedKind`` and ``GuidedError`` are in
``inferflow.sampling_params`` (this path warns, then works)."""

import warnings

from inferflow.sampling_params import GuidedConstraint, GuidedError, GuidedKind

__all__ = ["GuidedConstraint", "GuidedError", "GuidedKind"]

warnings.warn("inferflow.guided.constraint moved to inferflow.sampling_params",
              DeprecationWarning, stacklevel=2)
