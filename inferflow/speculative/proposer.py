"""Moved: ``DraftProposer`` and ``DraftRequest`` are in ``inferflow.scheduling.speculation``
(this path warns, then works; the n-gram proposer is ``inferflow.stages.speculative``)."""

import warnings

from inferflow.scheduling.speculation import DraftProposer, DraftRequest

__all__ = ["DraftProposer", "DraftRequest"]

warnings.warn("inferflow.speculative.proposer moved to inferflow.scheduling.speculation",
              DeprecationWarning, stacklevel=2)
