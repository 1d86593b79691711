"""The API processes: OpenAI and embeddings routes, request and response stages, protocol,
limits, errors, SSE. Of ``server/`` it imports only the root modules (``messages``,
``shared_state``, ``observability``, ...), never ``worker/``, ``process/`` or a host."""
