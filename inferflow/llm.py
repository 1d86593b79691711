"""Offline inference, as vLLM users know it::

    from inferflow import LLM, SamplingParams
    llm = LLM("/models/Llama-3.2-1B-Instruct")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inferflow.engine.llm_engine import LLMEngine
from inferflow.outputs import RequestOutput
from inferflow.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate from prompts on a checkpoint folder; runs the engine loop to completion.

    Keyword arguments are engine settings (``precision``, ``max_slots``, ``max_model_len``,
    ``graph_form``, ``intra_op_threads``, ...) and scheduler settings (``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``mode``, ...). ``backend="torch"``
    runs the torch executor (paged KV) and takes its settings instead of ONNX Runtime's:
    ``LLM(path, backend="torch", device="cuda", dtype="bfloat16", kv_cache_memory="0.9")``.
    ``generation_config``: ``"auto"`` (default) takes the checkpoint's generation_config.json as
    the default sampling parameters and adds its EOS ids, ``"none"`` ignores it, a folder reads
    that folder's (vLLM's ``generation_config``; ``inferflow/models/generation_config.py``).
    """

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        if model is None:
            from inferflow.models.tiny import tiny_llama_path

            model = tiny_llama_path()
        self.engine = LLMEngine.from_path(model, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is text or a list of token ids; ``use_tqdm`` shows a
        progress bar of finished requests (on stderr). Without ``sampling_params``: the
        model's defaults (``get_default_sampling_params``)."""
        batch: list[Any] = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) \
            else list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        order = []
        for prompt, given in zip(batch, per_prompt, strict=True):
            # only the final outputs are returned: none is built while a request runs
            p = dataclasses.replace(given, output_kind=RequestOutputKind.FINAL_ONLY)
            rid = str(next(self._ids))
            if isinstance(prompt, str):
                self.engine.add_request(rid, self.tokenizer.encode(prompt), p, prompt=prompt)
            else:
                self.engine.add_request(rid, list(prompt), p)
            order.append(rid)
        return self._run(order, use_tqdm)

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
