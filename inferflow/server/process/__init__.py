"""The main process: ``serve()``, the supervisor, model management, the embedding-only server.
It may import the rest of ``server/``: it starts the API processes and the workers of a host."""
