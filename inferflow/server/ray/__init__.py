"""The Ray Serve host (``server=ray``, the ``inferflow[ray]`` extra): the same serving graph as
one machine, as an ingress deployment and engine replicas. Nothing here is imported unless
``server=ray`` is selected (``host.serve_on_ray``). See docs/ray.md. It may import the rest of
``server/``; nothing in ``server/`` imports it (``cli`` picks it)."""
