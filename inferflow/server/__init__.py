"""The HTTP frontend: OpenAI-compatible routes on LitServe, with our engine loop and lifecycle.

Entry point: ``inferflow.server.runtime.serve(graph)`` (what ``python -m inferflow`` runs).
See ``docs/server.md`` for the process layout, endpoints, limits and shutdown behaviour.
"""
