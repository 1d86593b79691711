"""ONNX Runtime custom ops of inferflow, compiled on the machine that runs them.

One op today, ``inferflow.PagedAttention`` (domain ``inferflow``, since version 1): a decoder
layer's attention over a paged KV cache, one node per layer in the CPU graph form ``paged``
(rotary, the write of the step's new K/V through a slot mapping, attention over each row's
block table; decode rows and prefill chunks in one call).

Inputs: 0 ``qkv`` T (N, (Hq + 2 Hkv) D): per token [q heads | k heads | v heads];
1, 2 ``key_cache``, ``value_cache`` TKV (NB, Hkv, bs, D); 3 ``positions`` int64 (N,);
4 ``slot_mapping`` int64 (N,) = block * bs + offset; 5 ``block_tables`` int32 (B, W);
6 ``seq_lens`` int32 (B,) (row b's queries are positions seq_lens[b] - q_len .. seq_lens[b] - 1);
7 ``query_start`` int32 (B + 1,); 8, 9 ``cos_cache``, ``sin_cache`` float32 (P, rotary_dim / 2).
Outputs: 0 ``out`` T (N, Hq D); 1, 2 the caches after the write (bound to the inputs' memory by
the runner: the op works in place; otherwise it copies first). Attributes: ``num_heads``,
``kv_num_heads``, ``scale`` (0 = 1/sqrt(D)), ``softcap`` (0 = none), ``window`` (0 = none: key j
is visible to position p iff p - window < j <= p), ``rotary_dim`` (0 = none; non-interleaved).
(T, TKV): (float, float), (float16, float16), (float, float16); D a multiple of 8.

- ``headers``: ONNX Runtime's C/C++ headers (found, or fetched from Debian's libonnxruntime-dev);
- ``build``: compiles ``paged_attention.cc`` into ``<engine dir>/ops/<key>/`` (cached by content),
  ``paged_attention_library()``, ``op_status()``; ``INFERFLOW_ORT_OP=off`` disables the op;
- ``python -m inferflow.runtimes.ort_ops [info | build | fetch-headers]``.

Leaf package: imports only ``inferflow.paths``, the standard library, numpy and onnxruntime.
"""
