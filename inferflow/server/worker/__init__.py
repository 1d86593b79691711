"""The engine worker process: ``WorkerService`` (owns the engine), its loop and queues. Of
``server/`` it imports only the root modules; no host (LitServe, Ray) types reach it."""
