"""The LitServe host: every module that imports ``litserve`` lives here, beside ``server/ray/``.

``build`` (``serve(graph)``: what ``python -m inferflow`` runs), ``litserver``
(``InferflowServer``: LitServer with our process lifecycle), ``engine_api`` (the LitAPI whose
inference worker runs ``worker.EngineLoop`` over a ``worker.WorkerService``), ``spec`` (the
OpenAI routes as LitServe spec endpoints), ``direct_transport`` (worker -> API process updates)
and ``startup`` (per-API-process start and stop). It may import the rest of ``server/``
(``http/``, ``worker/``, ``process/``, the root modules); nothing there imports it.
"""
