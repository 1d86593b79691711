"""Test doubles, not product: stand-ins that tests, notebooks and benchmark demos run against.

``fake_server`` is a simulated OpenAI-compatible server with planted latencies (for the load
generator's tests and the benchmark notebook); ``simulate`` drives the real telemetry API with a
virtual clock (demo traces for the trace notebook). Nothing in the product imports this package;
it may import anything.
"""
