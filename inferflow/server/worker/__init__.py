"""The engine worker process: the LitAPI that owns the engine, its loop and queues."""
