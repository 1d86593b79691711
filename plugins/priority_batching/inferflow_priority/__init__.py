"""inferflow plugin: priority batching (a ``batching`` slot option) + its request tagger."""

from inferflow_priority.policy import PriorityBatching, PriorityTagger

__all__ = ["PriorityBatching", "PriorityTagger"]
