"""Speculative decoding: a proposer drafts tokens, the target model verifies them in the step.
Core layer beside ``scheduling/``: it imports nothing of inferflow.

- :mod:`inferflow.speculative.proposer`: the :class:`DraftProposer` contract and the n-gram
  (prompt lookup) proposer;
- the scheduler (``inferflow.scheduling.scheduler``) asks for drafts when it schedules decodes,
  puts them in the decode row and rolls the KV length back past the rejected ones;
- :mod:`inferflow.sampling.rejection` verifies a row's drafts against the target's logits
  (greedy: exact match; temperature > 0: rejection sampling, which keeps the target distribution).
"""

from inferflow.speculative.proposer import DraftProposer, DraftRequest, NgramProposer

__all__ = ["DraftProposer", "DraftRequest", "NgramProposer"]
