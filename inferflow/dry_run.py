"""``task=check``: the serving graph described as the server will build it, without serving.

``check(graph)`` sets up the request stages, pushes one prompt through them and returns the
report: the model, the request and response stages, the KV layout, then one line per stage in
the order a request meets them (request stages, the engine-side slots, response stages), each
with the ``_target_`` it was built from and its settings (its init fields; internals starting
with ``_`` and retired spellings such as ``batching.max_batch_size`` are left out).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from inferflow.config.schema import REQUEST_SLOTS, RESPONSE_SLOTS
from inferflow.graph.build import ServingGraph, build_entry_graph
from inferflow.graph.repository import llm_entries
from inferflow.stages.base import RequestStage
from inferflow.stages.batching import BatchingStage
from inferflow.stages.response import ResponseStage

# dataclass field metadata key: the field is an old spelling of the named one (not shown)
RENAMED_TO = "renamed_to"
_WORD = re.compile(r"[\w.:/@+-]+")


def check(graph: ServingGraph) -> str:
    """Set up the request stages, push one prompt through them, describe the graph.

    An embedding model (``model.task=embed``) is checked by loading its checkpoint and
    tokenizing the probe; extra embedding models (``extra_models``) are listed.
    """
    from inferflow.embeddings.models import embedding_specs

    if graph.model.is_embedding:
        from inferflow.models.bert import load_bert_checkpoint

        bert = load_bert_checkpoint(graph.model_path)
        ids = bert.tokenizer().encode_batch(["Hello, inferflow!"])[0]
        lines = [
            f"embedding model: {graph.model_name} ({graph.model_path}), probe: {len(ids)} tokens",
            *(_line(graph, name, stage) for name, stage in graph.engine_slots.items()),
        ]
    elif graph.config.get("models"):  # the model repository: every LLM entry's own graph
        lines = check_repository(graph) + stage_lines(graph)
    else:
        lines = check_llm(graph)
        lines += [f"note: {note}" for note in graph.notes()]
    lines += [
        f"extra model: {s.model_id} ({s.path}) weight={s.weight}"
        for s in embedding_specs(graph)
        if s.path != str(graph.model_path)
    ]
    server = graph.server
    lines.append(f"server: http://{server.host}:{server.port}{server.describe_host()}")
    lines.append(f"tracing: {graph.tracing.exporter.value}")
    return "\n".join(lines)


def check_llm(graph: ServingGraph) -> list[str]:
    """The generation model's part of the report (also each entry's, in a model repository)."""
    from inferflow.scheduling.kv_budget import describe_layout
    from inferflow.stages.base import StageRequest

    graph.setup_stages()
    probe = graph.process(StageRequest("check", prompt="Hello, inferflow!"))
    return [
        f"model: {graph.model_name} ({graph.model_path}), max_model_len={graph.max_model_len}",
        f"architecture: {graph.model_arch.summary()}",
        "request stages: " + _chain(graph.request_stages),
        "response stages: " + (_chain(graph.response_stages) or "none"),
        f"probe prompt: {len(probe.prompt_token_ids or [])} tokens",
        f"kv: {describe_layout(graph.kv_layout(), graph.served_context.budget)}",
        "stages in the order a request meets them (_target_, settings):",
        *stage_lines(graph),
    ]


def check_repository(graph: ServingGraph) -> list[str]:
    """``task=check`` of a model repository: each LLM entry's graph built and probed (the
    embedding entries are listed by the caller)."""
    entries = llm_entries(graph.config)
    lines = [f"model repository: {len(entries)} LLM(s)"]
    for entry in entries:
        entry_graph = build_entry_graph(entry)
        entry_graph.check_engine_settings()
        model = entry_graph.model
        precision = getattr(entry_graph.executor, "precision", None)
        lines.append(
            f"models.{entry.key}: {model.model_id} weight={model.weight} "
            f"load={entry.load.value} executor={entry_graph.executor.backend}"
            + (f" {getattr(precision, 'value', precision)}" if precision is not None else "")
        )
        lines += [f"  {line}" for line in check_llm(entry_graph)]
    lines.append("the top-level slots each entry inherits:")
    return lines


def _chain(stages: Sequence[RequestStage | ResponseStage]) -> str:
    return " -> ".join(f"{s.name} ({type(s).__name__})" for s in stages)


def stage_lines(graph: ServingGraph) -> list[str]:
    """``  NAME: Class _target_=... key=value ...`` for every stage, in pipeline order."""
    added_by = {
        stage.name: slot
        for slot, engine_stage in graph.engine_slots.items()
        for stage in engine_stage.request_stages()
    }
    lines = []
    for stage in graph.request_stages:
        origin = added_by.get(stage.name) if stage.name not in REQUEST_SLOTS else None
        lines.append(_line(graph, stage.name, stage, origin))
    lines += [_line(graph, name, stage) for name, stage in graph.engine_slots.items()]
    lines += [_line(graph, stage.name, stage) for stage in graph.response_stages]
    for name in RESPONSE_SLOTS:  # the parsers (``auto``: which one the chat template chose)
        parser = getattr(graph, name)
        line = _line(graph, name, parser)
        chosen = parser.resolved
        lines.append(line if chosen is parser else f"{line} (chosen: {chosen.option})")
    return lines


def _line(graph: ServingGraph, name: str, stage: object, added_by: str | None = None) -> str:
    text = f"  {name}: {type(stage).__name__} _target_={_target(graph, name, stage)}"
    if added_by is not None:
        text += f" (added by {added_by})"
    settings = stage_settings(stage)
    return f"{text} {settings}" if settings else text


def _target(graph: ServingGraph, name: str, stage: object) -> str:
    """The ``_target_`` the stage was built from (its class's path when another stage made it)."""
    slot = name in graph.engine_slots or name in REQUEST_SLOTS or name in RESPONSE_SLOTS
    node = graph.config.get(name) if slot else None
    if node is None:
        node = (graph.config.get("stages") or {}).get(name)
    target = node.get("_target_") if node is not None else None
    return str(target) if target else f"{type(stage).__module__}.{type(stage).__qualname__}"


def stage_settings(stage: object) -> str:
    """``key=value`` for each config key of ``stage`` (a dataclass's init fields), as built."""
    if not dataclasses.is_dataclass(stage) or isinstance(stage, type):
        return ""
    items = [
        (f.name, getattr(stage, f.name))
        for f in dataclasses.fields(stage)
        if f.init and not f.name.startswith("_") and RENAMED_TO not in f.metadata
    ]
    if isinstance(stage, BatchingStage):
        items = [(k, _policy(stage) if k == "policy" else v) for k, v in items]
    return " ".join(f"{k}={_show(_plain(v))}" for k, v in items)


def _show(value: object) -> str:
    """A value on one line: a string quoted unless it is one plain word (``fp32``, ``auto``)."""
    if isinstance(value, str) and not _WORD.fullmatch(value):
        return repr(value)
    return str(value)


def _policy(stage: BatchingStage) -> str:
    """The policy in effect: the built-in one ``policy`` names, unless the class orders the
    queue itself (a plugin's ``sort_key``), which the scheduler then uses."""
    sort_key = type(stage).sort_key
    if sort_key is BatchingStage.sort_key:
        return str(_plain(stage.policy))
    return sort_key.__qualname__


def _plain(value: object) -> object:
    value = getattr(value, "value", value)  # enums
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
