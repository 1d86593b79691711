"""The main process: serve(), the LitServer subclass, the supervisor, shared state."""
