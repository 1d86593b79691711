"""The main process: what every host builds from a graph (``runtime``), the supervisor, model
management, the API process shell, the embedding-only server. It may import ``http/``,
``worker/`` and the root modules, never a host (``litserve/``, ``ray/``): the hosts use it."""
