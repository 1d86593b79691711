"""The built-in options of each slot group and their Hydra schemas.

``conf/<slot>/<option>.yaml`` instantiates the class listed here; :func:`register_configs` stores
each class's schema (its dataclass fields + ``_target_``, ``config.base.stage_schema``) in
Hydra's ConfigStore, so a bad value or an unknown key fails at composition with the key's name.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from inferflow.config.base import stage_schema
from inferflow.config.schema import InferflowConfig
from inferflow.config.server import RayServerConfig
from inferflow.stages.base import PassThroughStage
from inferflow.stages.batching import (
    ContinuousBatching,
    DynamicBatching,
    NoBatching,
    StaticBatching,
)
from inferflow.stages.cache import NoPrefixCache, PrefixCache
from inferflow.stages.detokenizer import StreamingDetokenizer
from inferflow.stages.executor import OnnxRuntimeExecutor, TensorRTExecutor
from inferflow.stages.guided import LLGuidanceDecoding, NoGuidedDecoding
from inferflow.stages.lora import LoraStage
from inferflow.stages.reasoning_parser import (
    AutoReasoningParser,
    NoReasoningParser,
    ThinkReasoningParser,
)
from inferflow.stages.speculative import NgramSpeculation, NoSpeculation
from inferflow.stages.tokenizer import CheckpointTokenizer
from inferflow.stages.tool_parser import TOOL_PARSERS, AutoToolParser
from inferflow.stages.torch_executor import TorchExecutor
from inferflow.stages.validator import RequestValidator

# Built-in options of each slot group -> the class its conf/<group>/<option>.yaml instantiates.
BUILTIN_OPTIONS: dict[str, dict[str, type]] = {
    "validator": {"default": RequestValidator, "none": PassThroughStage},
    "tokenizer": {"default": CheckpointTokenizer},
    "cache": {"prefix": PrefixCache, "none": NoPrefixCache},
    "batching": {
        "none": NoBatching,
        "static": StaticBatching,
        "dynamic": DynamicBatching,
        "continuous": ContinuousBatching,
    },
    "executor": {
        "onnxruntime": OnnxRuntimeExecutor,
        "tensorrt": TensorRTExecutor,
        "torch": TorchExecutor,
    },
    "detokenizer": {"default": StreamingDetokenizer},
    "guided": {"llguidance": LLGuidanceDecoding, "none": NoGuidedDecoding},
    "speculative": {"none": NoSpeculation, "ngram": NgramSpeculation},
    "lora": {"default": LoraStage},
    "reasoning_parser": {
        "auto": AutoReasoningParser,
        "think": ThinkReasoningParser,
        "none": NoReasoningParser,
    },
    "tool_parser": {"auto": AutoToolParser, **TOOL_PARSERS},
}


# Slot groups whose option ``inferflow tune`` may choose (each option's own tunable fields then
# join the search space: ``speculative.num_speculative_tokens`` exists with ``ngram`` only).
TUNABLE_OPTIONS: dict[str, tuple[str, ...]] = {
    "cache": ("prefix", "none"),
    "speculative": ("none", "ngram"),
}
# Of those, the groups whose choice the tuner's engine model cannot see (it leaves speculative
# decoding out: acceptance depends on the text): real runs decide them, as for the fields
# declared ``tunable(..., simulated=False)``.
UNMODELLED_OPTIONS: frozenset[str] = frozenset({"speculative"})


def schema_name(group: str, option: str) -> str:
    """ConfigStore name of a built-in option's schema (a root-level config, so it is not listed
    as a selectable group option): referenced as ``- /<name>@_here_`` in the option's YAML."""
    return f"{group}_{option}_schema"


def register_configs(store: ConfigStore | None = None) -> None:
    """Store the root schema and every built-in option's schema (idempotent)."""
    cs = store or ConfigStore.instance()
    cs.store(name="inferflow_schema", node=InferflowConfig)
    cs.store(name=schema_name("server", "ray"), node=RayServerConfig)
    for group, options in BUILTIN_OPTIONS.items():
        for option, cls in options.items():
            cs.store(name=schema_name(group, option), node=stage_schema(cls))
