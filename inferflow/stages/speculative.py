"""The ``speculative`` slot: speculative decoding (a proposer drafts, the target verifies).

Contract (:class:`SpeculativeStage`): :meth:`proposer` builds the scheduler's
:class:`~inferflow.speculative.proposer.DraftProposer` once, in the engine worker (``None``: no
speculation). Verification is the engine's own: decode rows carry the drafts in the normal
batched step, the sampler accepts or rejects them (``inferflow.sampling.rejection``), the
scheduler rolls the KV length back past rejected ones. Output is the same as without
speculation: token for token under greedy decoding, in distribution at temperature > 0.

Built-ins: ``speculative=none`` (:class:`NoSpeculation`, the default) and ``speculative=ngram``
(:class:`NgramSpeculation`, prompt lookup). A draft-model proposer is a class with a
``proposer()`` that returns one (its own ``_target_``).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from inferflow.speculative.proposer import DraftProposer


@dataclass
class SpeculativeStage(EngineStage):
    """Contract of the ``speculative`` slot (see the module docstring)."""

    kind: ClassVar[str] = "speculative"

    @abstractmethod
    def proposer(self) -> DraftProposer | None:
        """The scheduler's draft proposer (None: decode one token a step)."""

    @property
    def enabled(self) -> bool:
        return True


@dataclass
class NoSpeculation(SpeculativeStage):
    """One token per decode step (the default; what ``~speculative`` gives too)."""

    def proposer(self) -> DraftProposer | None:
        return None

    @property
    def enabled(self) -> bool:
        return False


@dataclass
class NgramSpeculation(SpeculativeStage):
    """Prompt lookup: the drafts are the ``num_speculative_tokens`` tokens that followed the
    most recent earlier occurrence of the sequence's last ``n`` tokens, ``n`` from
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` (vLLM's ``method: ngram``). Costs no
    model; pays off where output repeats its context (code edits, extraction, quoting)."""

    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        from inferflow.speculative.proposer import NgramProposer

        NgramProposer(self.num_speculative_tokens, self.prompt_lookup_min,
                      self.prompt_lookup_max)  # the range checks, at config time

    def proposer(self) -> DraftProposer | None:
        from inferflow.speculative.proposer import NgramProposer

        return NgramProposer(self.num_speculative_tokens, self.prompt_lookup_min,
                             self.prompt_lookup_max)
