"""The torch runner: the Llama-family decoder in torch (``model``) over a paged KV pool
(``attention``; on CUDA the Triton kernels ``triton_paged`` (decode) and ``triton_extend``
(prefill chunks); ``step_batch``), compiled by Inductor with CUDA graphs
(``runner``) into a cached folder (``engine_dir``). Like the rest of ``runtimes/`` it imports
``models/``, ``scheduling/`` (the KV layout, the plan) and ``sampling/``, nothing above.
"""
