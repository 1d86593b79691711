"""Offline inference, as vLLM users know it::

    from inferflow import LLM, SamplingParams
    llm = LLM("/models/Llama-3.2-1B-Instruct")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferflow.engine.choices import Choice, fan_out, merge
from inferflow.outputs import RequestOutput
from inferflow.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from inferflow.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# keyword -> the config key it sets (the server's). A key without a dot is a config group: the
# value picks its option (``backend="torch"`` -> ``executor=torch``). A keyword not listed is an
# executor setting (``precision`` -> ``executor.precision``).
KEYWORDS: dict[str, str] = {
    "max_num_seqs": "batching.max_num_seqs",
    "max_num_batched_tokens": "batching.max_num_batched_tokens",
    "enable_chunked_prefill": "batching.enable_chunked_prefill",
    "long_prefill_token_threshold": "batching.long_prefill_token_threshold",
    "policy": "batching.policy",
    "mode": "batching",
    "backend": "executor",
    "enable_prefix_caching": "cache",  # True: cache=prefix, False: cache=none
    "block_size": "cache.block_size",
    "num_blocks": "cache.num_blocks",
    "max_model_len": "model.max_model_len",
    "generation_config": "model.generation_config",
    "speculative_config": "speculative",  # {"method": "ngram", ...}: speculative=ngram ...
    "lora_adapters": "lora.adapters",  # {"NAME": PATH}: lora.adapters.NAME=PATH each
    "enable_lora": "lora.allow_runtime_updates",  # LoRA on with no adapter yet (load_lora)
    "max_loras": "lora.max_loras",
    "max_lora_rank": "lora.max_lora_rank",
    "max_cpu_loras": "lora.max_cpu_loras",
}


class LLM:
    """Generate from prompts on a checkpoint folder; runs the engine loop to completion.

    The engine is the one ``python -m inferflow`` serves (``build_graph(...).create_engine()``),
    with the server's defaults; keyword arguments are config overrides through ``KEYWORDS``:
    ``max_num_seqs`` is ``batching.max_num_seqs``, ``mode="static"`` is ``batching=static``,
    ``backend="torch"`` is ``executor=torch``, ``enable_prefix_caching=False`` is ``cache=none``,
    and any executor setting by its name (``precision``, ``max_slots``, ``graph_form``,
    ``intra_op_threads``, ``kv_cache_memory``; torch: ``device``, ``dtype``, ``compile``).
    ``LLM(path, backend="torch", device="cuda", dtype="bfloat16", kv_cache_memory="0.9")``.
    ``speculative_config={"method": "ngram", "num_speculative_tokens": 4}`` (vLLM's form) turns
    speculative decoding on. ``lora_adapters={"sql": "/adapters/sql"}`` serves PEFT adapters
    (``lora.adapters``; with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``;
    ``enable_lora=True`` turns LoRA on without adapters, for :meth:`load_lora`), selected with
    ``generate(..., lora="sql")``. ``generation_config``: ``"auto"`` (default) takes the checkpoint's
    generation_config.json as the default sampling parameters and adds its EOS ids, ``"none"``
    ignores it, a folder reads that folder's (vLLM's ``generation_config``). A bad value is a
    ValueError whose message starts with the keyword.
    """

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        from hydra.errors import ConfigCompositionException

        from inferflow.compose import compose_config
        from inferflow.graph import build_graph

        overrides = [] if model is None else ["model=local", f"model.path={_value(str(model))}"]
        try:
            cfg = compose_config(overrides + [o for k, v in kwargs.items() for o in _overrides(k, v)])
            graph = build_graph(cfg)
            self.engine: LLMEngine = graph.create_engine()
        except (ValueError, ConfigCompositionException) as exc:
            raise _keyword_error(exc) from None
        for note in graph.notes():  # as the server logs them at start
            logger.warning("inferflow: %s", note)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is text or a list of token ids; ``use_tqdm`` shows a
        progress bar of finished requests (on stderr). Without ``sampling_params``: the
        model's defaults (``get_default_sampling_params``). ``n`` > 1 (or ``best_of``): a
        prompt's output holds ``n`` sequences, generated as engine requests that share the
        prompt's KV (``inferflow.engine.choices``). ``lora``: the LoRA adapter (a loaded
        adapter's name; None: the base model) of every prompt, or one per prompt (a list: the
        prompts of different adapters and the base model run in the same steps)."""
        batch: list[Any] = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) \
            else list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        adapters = [lora] * len(batch) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(batch):
            raise ValueError(f"lora: {len(adapters)} adapters for {len(batch)} prompts")
        order: list[tuple[str, SamplingParams, list[Choice]]] = []
        for prompt, given, adapter in zip(batch, per_prompt, adapters, strict=True):
            # only the final outputs are returned: none is built while a request runs
            p = dataclasses.replace(given, output_kind=RequestOutputKind.FINAL_ONLY)
            rid = str(next(self._ids))
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            choices = fan_out(rid, p)  # n / best_of: one engine request per sequence
            for choice in choices:
                self.engine.add_request(choice.request_id, ids, choice.params, prompt=text,
                                        prompt_leader=choice.prompt_leader, lora=adapter)
            order.append((rid, p, choices))
        final = iter(self._run([c.request_id for _, _, cs in order for c in cs], use_tqdm))
        outputs = []
        for rid, p, choices in order:
            outs = [next(final) for _ in choices]
            outputs.append(outs[0] if len(choices) == 1 else merge(rid, p, outs))
        return outputs

    def load_lora(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (``LLMEngine.load_lora``)."""
        self.engine.load_lora(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (``LLMEngine.unload_lora``)."""
        self.engine.unload_lora(name)

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list of them)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(conv) for conv in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation config's defaults (temperature, top_p, top_k,
        max_tokens from max_new_tokens) where it sets them, else SamplingParams' own (vLLM's)."""
        return self.engine.checkpoint.generation.sampling_params()

    def _run(self, order: list[str], use_tqdm: bool = False) -> list[RequestOutput]:
        from tqdm import tqdm

        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[rid] for rid in order]


def _value(value: Any) -> str:
    """``value`` in override syntax: strings quoted (a path may hold any character)."""
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def _overrides(keyword: str, value: Any) -> list[str]:
    key = KEYWORDS.get(keyword, f"executor.{keyword}")
    if keyword == "enable_prefix_caching":
        return [f"cache={'prefix' if value else 'none'}"]
    if keyword == "speculative_config":
        settings = dict(value or {"method": "none"})
        method = settings.pop("method", None)
        if not isinstance(method, str) or not method.isidentifier():
            raise ValueError(f"speculative_config.method: got {method!r}")
        return [f"speculative={method}", *(f"speculative.{k}={_value(v)}" for k, v in settings.items())]
    if keyword == "lora_adapters":
        return [f"{key}.{name}={_value(str(path))}" for name, path in dict(value or {}).items()]
    if "." not in key:  # a group: the value names its option
        return [f"{key}={value}"]
    return [f"{key}={_value(value)}"]


def _keyword_error(exc: Exception) -> Exception:
    """A config error as the keyword that caused it: ``executor.kv_cache_memory: ...`` becomes
    ``kv_cache_memory: ...``; a missing group option or a key the chosen option lacks names the
    keyword."""
    from hydra.errors import ConfigCompositionException, MissingConfigException

    from inferflow.config import ConfigError

    if isinstance(exc, MissingConfigException):
        group = str(exc.missing_cfg_file).split("/")[0]
        keyword = _keyword_of(group)
        if keyword == "speculative_config":
            keyword = "speculative_config.method"
        return ConfigError(f"{keyword}: must be one of {sorted(exc.options or [])}", keyword)
    if isinstance(exc, ConfigCompositionException):  # "Could not override 'batching.x'." or
        first = str(exc).splitlines()[0]  # "Error merging override executor.precision='fp64'"
        found = re.search(r"override '?([\w.]+)", first)
        keyword = _keyword_of(found.group(1) if found else "")
        cause = str(exc.__cause__).splitlines()[0] if exc.__cause__ is not None else first
        return ConfigError(f"{keyword}: {cause}", keyword)
    key = exc.key if isinstance(exc, ConfigError) else None
    message = str(exc)
    if key is None or not message.startswith(f"{key}:"):
        return exc
    return ConfigError(_keyword_of(key) + message[len(key):], _keyword_of(key))


def _keyword_of(key: str) -> str:
    """The keyword that sets config ``key`` (``executor.precision`` -> ``precision``)."""
    exact = {v: k for k, v in KEYWORDS.items()}
    if key in exact or key.startswith("executor."):
        return exact.get(key, key.removeprefix("executor."))
    group, _, rest = key.partition(".")  # under a group keyword: speculative.x -> speculative_config.x
    return f"{exact.get(group, group)}.{rest}" if rest else key
