"""The API processes: OpenAI routes, request and response stages, protocol, limits, errors, SSE."""
