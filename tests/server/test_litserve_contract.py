"""What inferflow relies on in LitServe beyond its public surface, pinned (LitServe 0.2.19).

docs/server.md ("LitServe: public surface and what is still private") lists each item with the
reason. An upgrade that changes any of them fails here with one message naming every method
that moved, before a server test fails in some stranger way.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import litserve as ls
from litserve import server as ls_server
from litserve.loops import base as ls_loop_base
from litserve.loops import loops as ls_loops
from litserve.specs import base as ls_spec
from litserve.transport import base as ls_transport_base

from inferflow.server.litserve.engine_api import EngineAPI, WorkerLoop
from inferflow.server.litserve.litserver import InferflowServer

# name: (object, parameters with defaults, sha256[:12] of its source or None: signature only)
PINNED: dict[str, tuple[Any, str, str | None]] = {
    # replaced by InferflowServer.run: its steps are redone by ours (a new step must be seen)
    "LitServer.run": (
        ls.LitServer.run,
        "(self, host='0.0.0.0', port=8000, num_api_servers=None, log_level='info', "
        "generate_client_file=True, api_server_worker_type='process', pretty_logs=False, "
        "**kwargs)",
        "a53f4b3f53ea",
    ),
    # replaced by InferflowServer.lifespan: its tuple reader cannot share our response queue
    "LitServer.lifespan": (ls.LitServer.lifespan, "(self, app)", "6e72c5b311cc"),
    # called by InferflowServer.run / launch / fresh_queue
    "LitServer._get_request_queue": (
        ls.LitServer._get_request_queue,
        "(self, api_path)",
        "38816280110b",
    ),
    "LitServer.launch_inference_worker": (
        ls.LitServer.launch_inference_worker,
        "(self, lit_api)",
        "15d290e5a5ee",
    ),
    "LitServer.launch_single_inference_worker": (
        ls.LitServer.launch_single_inference_worker,
        "(self, lit_api, worker_id)",
        "c2d7b5b4cdf1",
    ),
    # how the worker enters WorkerLoop.__call__ (which runs EngineLoop.run)
    "loops.inference_worker": (
        ls_loops.inference_worker,
        "(lit_api, device, worker_id, request_queue, transport, workers_setup_status, "
        "callback_runner, restart_workers)",
        "f7d46425b66a",
    ),
    "_BaseLoop.__call__": (
        ls_loop_base._BaseLoop.__call__,
        "(self, lit_api, device, worker_id, request_queue, transport, workers_setup_status, "
        "callback_runner)",
        "510abb166c25",
    ),
    "LitSpec.setup": (ls_spec.LitSpec.setup, "(self, server)", "b58638f82a95"),
    # the transport interface DirectTransport implements (LitServe hands it to the worker)
    "MessageTransport.send": (
        ls_transport_base.MessageTransport.send,
        "(self, item, consumer_id)",
        None,
    ),
    "MessageTransport.areceive": (
        ls_transport_base.MessageTransport.areceive,
        "(self, timeout=None, consumer_id=None)",
        None,
    ),
    "MessageTransport.close": (ls_transport_base.MessageTransport.close, "(self, **kwargs)", None),
}

# LitServer methods InferflowServer may override (docs/server.md says why for each).
ALLOWED_SERVER_OVERRIDES = {"__init__", "run", "lifespan"}


def _signature(func: Any) -> str:
    """Parameter names and defaults (annotations can embed object addresses)."""
    parts = []
    for p in inspect.signature(func).parameters.values():
        star = {p.VAR_KEYWORD: "**", p.VAR_POSITIONAL: "*"}.get(p.kind, "")
        default = "" if p.default is p.empty else f"={p.default!r}"
        parts.append(f"{star}{p.name}{default}")
    return "(" + ", ".join(parts) + ")"


def _digest(func: Any) -> str:
    return hashlib.sha256(inspect.getsource(inspect.unwrap(func)).encode()).hexdigest()[:12]


def test_litserve_private_surface_is_unchanged() -> None:
    drift = [
        f"{name}: signature is now {_signature(f)}, inferflow expects {sig}"
        for name, (f, sig, _) in PINNED.items()
        if _signature(f) != sig
    ]
    drift += [
        f"{name}: its source changed ({_digest(f)} != {digest}); re-check inferflow's use of it"
        for name, (f, _, digest) in PINNED.items()
        if digest is not None and _digest(f) != digest
    ]
    if "_spec" not in vars(ls.LitAPI()):
        drift.append("LitAPI._spec is gone (EngineAPI.__getstate__ drops it before pickling)")
    if ls_server._MCP_AVAILABLE:
        drift.append("litserve.server._MCP_AVAILABLE: our lifespan does not start mcp_server")
    init = inspect.signature(ls.LitServer.__init__).parameters
    drift += [
        f"LitServer.__init__ lost {name!r}"
        for name in ("healthcheck_path", "info_path", "middlewares", "spec")
        if name not in init
    ]
    assert not drift, "LitServe changed what inferflow relies on (docs/server.md):\n" + "\n".join(
        drift
    )


def test_only_the_documented_litserve_methods_are_overridden() -> None:
    overridden = {n for n in vars(InferflowServer) if hasattr(ls.LitServer, n)} - {
        "__module__",
        "__doc__",
    }
    assert overridden == ALLOWED_SERVER_OVERRIDES, sorted(overridden)
    assert issubclass(WorkerLoop, ls_loop_base.LitLoop)  # a public LitLoop, not a fork of one
    assert callable(EngineAPI.authorize) and callable(EngineAPI.health)  # public hooks
