"""The ingress replica's side of the engine deployments: requests out, updates in.

``EngineHub`` is what LitServe's request queues and the ``DirectTransport`` are on one machine,
for every LLM of the repository at once (one engine deployment per ``models:`` entry):

- ``queue(key).put(SubmitRequest)`` starts a ``DeploymentHandle`` call to that model's engine
  deployment (``generate(request, reply_to)``, routed by ``PrefixAffinityRouter``); the call
  returns when the request is over. ``put(CancelRequest)`` cancels it (and so the request in
  its replica).
- The updates arrive apart from the calls, one message per engine flush from each replica
  (``transport.UpdateReceiver``), and go to the requests' channels in one dispatch.
- **A lost replica before the first token is a wait, not an error**: a call that fails (the
  replica died, or was stopping and said so) before anything of the request reached the client
  is made again -- the router picks a live replica, or waits for the replacement -- for up to
  ``REPLACEMENT_WAIT_S``. Once the client has tokens, the request ends with an explicit 503
  ``replica_lost`` (an SSE error event on a stream), as before.
- ``probe(key, replica_id)`` sends a call through the same path to one replica
  (``ReplicaProbe``): what readiness waits for. ``wake`` (``LoadRequests``) sends an untargeted
  one to an on-demand model's deployment, which makes Serve scale it up from zero.
- A LoRA ``LoadLora``/``UnloadLora`` goes to every routable replica of the model (one targeted
  call each, one after the other; a call Serve's router hands to another replica is refused
  there, ``Misrouted``, and sent again), is recorded on the board first (replicas that start
  later apply it), and is answered once all answered: the first error, else the success text.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from inferflow.config import LoadMode
from inferflow.server.http.deployments import LoadRequests
from inferflow.server.http.lora import LORA_CONTROL_TIMEOUT_S
from inferflow.server.messages import (
    CancelRequest,
    ErrorInfo,
    LoadLora,
    RequestUpdate,
    SubmitRequest,
    UnloadLora,
    UpdateBatch,
)
from inferflow.server.ray.routing import MISROUTED, ReplicaProbe
from inferflow.server.ray.transport import UpdateReceiver
from inferflow.server.shared_state import LoadState

if TYPE_CHECKING:
    from inferflow.server.http.frontend import Frontend

logger = logging.getLogger(__name__)

RETRYABLE = ("replica_lost", "shutting_down")  # a replica's own "I cannot run it" answers
REPLACEMENT_WAIT_S = 30.0  # a request that met a lost replica before its first token retries
RETRY_PAUSE_S = 0.2
FINAL_GRACE_S = 10.0  # a call returned: its final update (sent before) arrives within this
PROBE_TIMEOUT_S = 10.0
CONTROL_ATTEMPTS = 20  # a control call the router misroutes is sent again this many times at most


def replica_lost(detail: object) -> ErrorInfo:
    return ErrorInfo(
        503,
        f"the engine replica serving this request was lost ({detail}); retry",
        code="replica_lost",
        retry_after_s=1,
    )


@dataclass
class _Call:
    """One request's call as the hub sees it."""

    delivered: bool = False  # some update of it reached its channel (the client may have it)
    retry_error: ErrorInfo | None = None  # its replica could not run it, before any token
    final: asyncio.Event = field(default_factory=asyncio.Event)


def own_request_context() -> None:
    """Give the handle calls made from the current task request ids of their own.

    Serve stamps every handle call with the request context of the HTTP request it is made in,
    and its router hands a chosen replica to the pending call with that internal request id:
    calls of one HTTP request in flight at once (``n`` > 1 choices, a LoRA load sent to each
    replica) would take each other's replicas, and one of them would never be routed. Each of
    our tasks clears the context (a copy: the HTTP handler's is untouched)."""
    try:
        from ray.serve.context import _serve_request_context
    except ImportError:  # (another Ray: its calls keep the request's context)
        return
    _serve_request_context.set(None)


async def settle(response: Any, timeout: float | None) -> Any:
    """Await a ``DeploymentResponse`` for at most ``timeout`` s; cancel the call if this is
    cancelled or times out."""

    async def result() -> Any:
        return await response

    try:
        return await asyncio.wait_for(result(), timeout)
    except BaseException:
        response.cancel()
        raise


class EngineQueue:
    """The request queue of one model on the Ray host (``Deployment.request_queue``)."""

    def __init__(self, hub: EngineHub, key: str) -> None:
        self.hub, self.key = hub, key

    def put(self, message: Any) -> None:
        self.hub.put(self.key, message)


class EngineHub:
    """Calls to the engine deployments (``handles``: models: key -> ``DeploymentHandle``) and
    the updates coming back. ``start`` runs on the ingress's event loop (its ASGI startup)."""

    def __init__(
        self,
        handles: dict[str, Any],
        frontend: Frontend,
        receiver: UpdateReceiver,
        record_adapter: Callable[[str, str, str | None], Awaitable[None]],
        routable: Callable[[str], list[str]],
    ) -> None:
        self.handles = handles
        self.frontend = frontend
        self.receiver = receiver
        self.record_adapter = record_adapter  # (model key, name, path or None) onto the board
        self.routable = routable  # model key -> its routable replica ids
        self.address = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.calls: dict[str, _Call] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.controls: dict[str, asyncio.Future[RequestUpdate]] = {}
        self.warming: dict[str, asyncio.Task[None]] = {}
        # model key -> adapter -> path (None: unloaded) that this ingress changed at run time
        # and the replicas' reports may not show yet
        self.adapter_changes: dict[str, dict[str, str | None]] = {}

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.address = self.receiver.start(self._on_batch)

    def close(self) -> None:
        self.receiver.close()

    def queue(self, key: str) -> EngineQueue:
        return EngineQueue(self, key)

    # --- messages from the frontend (its event loop) --------------------------------------------
    def put(self, key: str, message: Any) -> None:
        if isinstance(message, SubmitRequest):
            request_id = message.request_id
            task = asyncio.get_running_loop().create_task(self._run(key, message))
            self.tasks[request_id] = task
            task.add_done_callback(lambda _: self.tasks.pop(request_id, None))
        elif isinstance(message, CancelRequest):
            running = self.tasks.pop(message.request_id, None)
            if running is not None:
                running.cancel()
        elif isinstance(message, LoadLora | UnloadLora):
            asyncio.get_running_loop().create_task(self._answer_control(key, message))

    def _dispatch(self, *updates: RequestUpdate) -> None:
        self.frontend.registry.dispatch(UpdateBatch(tuple(updates)))

    def _on_batch(self, batch: UpdateBatch) -> None:
        """Updates from an engine replica: to the channels in one dispatch; LoRA answers to the
        control waiting for them; a replica's lost/stopping answer to a request nothing of which
        reached the client is held back (the request is made again)."""
        forward = []
        for update in batch.updates:
            call = self.calls.get(update.request_id)
            if call is None:
                control = self.controls.get(update.request_id)
                if control is not None:
                    if not control.done():
                        control.set_result(update)
                    continue
                forward.append(update)  # (a request that ended here already: dropped there)
                continue
            error = update.error
            if error is not None and error.code in RETRYABLE and not call.delivered:
                call.retry_error = error
                call.final.set()
                continue
            call.delivered = True
            if update.final:
                call.final.set()
            forward.append(update)
        if forward:
            self._dispatch(*forward)

    # --- a request ------------------------------------------------------------------------------
    async def _run(self, key: str, request: SubmitRequest) -> None:
        own_request_context()
        rid = request.request_id
        give_up = time.monotonic() + REPLACEMENT_WAIT_S
        if request.deadline is not None:
            give_up = min(give_up, time.monotonic() + request.deadline - time.time())
        call = self.calls[rid] = _Call()
        error: ErrorInfo
        try:
            while True:
                call.retry_error = None
                call.final.clear()
                response = self.handles[key].generate.remote(request, self.address)
                try:
                    await settle(response, None)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the replica died or became unreachable
                    logger.warning("request %s: engine replica lost: %s", rid, exc)
                    error = replica_lost(type(exc).__name__)
                else:
                    try:
                        await asyncio.wait_for(call.final.wait(), FINAL_GRACE_S)
                    except TimeoutError:
                        error = replica_lost("its last update did not arrive")
                        break
                    if call.retry_error is None:
                        return  # its final update went to its channel
                    error = call.retry_error
                if call.delivered or time.monotonic() >= give_up or self.frontend.is_draining():
                    break
                logger.info(
                    "request %s: its replica could not run it (%s); trying again", rid, error.code
                )
                await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            self.calls.pop(rid, None)
        self._dispatch(RequestUpdate(request_id=rid, error=error))

    # --- readiness and scale from zero -------------------------------------------------------------
    async def probe(self, key: str, replica_id: str) -> bool:
        """Whether replica ``replica_id`` of model ``key`` answers a call through the request
        path (this ingress's handle and router)."""
        own_request_context()
        response = self.handles[key].probe.remote(ReplicaProbe(replica_id))
        try:
            return bool(await settle(response, PROBE_TIMEOUT_S) == replica_id)
        except Exception as exc:
            logger.debug("probe of %s/%s: %s", key, replica_id, exc)
            return False

    def wake(self) -> None:
        """``LoadRequests.wake``: every on-demand model a request waits for gets a call that
        makes Serve start a replica (scale from zero); one at a time per model."""
        for deployment in self.frontend.deployments:
            key = deployment.key
            if (
                deployment.load is LoadMode.on_demand
                and deployment.shared.load_waiters > 0
                and not deployment.serving
                and key not in self.warming
                and self.loop is not None
            ):
                task = self.loop.create_task(self._warm(deployment))
                self.warming[key] = task
                task.add_done_callback(self._warmed(key))

    def _warmed(self, key: str) -> Callable[[asyncio.Task[None]], None]:
        def done(_: asyncio.Task[None]) -> None:
            self.warming.pop(key, None)

        return done

    async def _warm(self, deployment: Any) -> None:
        own_request_context()
        shared = deployment.shared
        shared.set_load_state(LoadState.LOADING)
        timeout = self.frontend.settings.model_load_timeout_s
        try:
            await settle(self.handles[deployment.key].probe.remote(ReplicaProbe()), timeout)
        except Exception as exc:
            reason = (
                f"no replica started within {timeout:g} s"
                if isinstance(exc, TimeoutError)
                else f"{type(exc).__name__}: {exc}"
            )
            logger.warning("model %s: %s", deployment.model_id, reason)
            shared.publish_info({"load_error": reason, "failed_at": time.time()})
            shared.set_load_state(LoadState.FAILED)

    # --- LoRA adapters on every replica ----------------------------------------------------------
    async def _answer_control(self, key: str, message: LoadLora | UnloadLora) -> None:
        own_request_context()  # (the per-replica calls inherit it)
        try:
            await self._control(key, message)
        except Exception as exc:  # e.g. the board is unreachable: answer, do not leave it hanging
            logger.warning("LoRA %s of %r: %s", type(message).__name__, message.name, exc)
            error = ErrorInfo(
                503,
                f"the adapter change failed: {type(exc).__name__}: {exc}",
                code="not_ready",
                retry_after_s=1,
            )
            self._dispatch(RequestUpdate(message.request_id, error=error))

    async def _control(self, key: str, message: LoadLora | UnloadLora) -> None:
        replicas = self.routable(key)
        if not replicas:
            self._dispatch(
                RequestUpdate(
                    message.request_id,
                    error=ErrorInfo(
                        503,
                        "no replica of the model is ready; adapters load into running engines",
                        code="not_ready",
                        retry_after_s=1,
                    ),
                )
            )
            return
        name = message.name
        path = message.path if isinstance(message, LoadLora) else None
        # recorded first: a replica that starts meanwhile applies it itself
        await self.record_adapter(key, name, path)
        # one replica after the other: Serve's router may swap the replicas of concurrent calls
        # (each replica refuses a call meant for another, and it is sent again, but calls in
        # flight together can keep swapping); an adapter change is rare and takes milliseconds
        answers = [
            await self._control_one(
                key, rid, replace(message, request_id=f"{message.request_id}.{i}")
            )
            for i, rid in enumerate(replicas)
        ]
        failed = [a for a in answers if a.error is not None]
        if failed and isinstance(message, LoadLora):  # not served anywhere, then
            await self.record_adapter(key, name, None)
            done = [rid for rid, a in zip(replicas, answers, strict=True) if a.error is None]
            for i, rid in enumerate(done):
                await self._control_one(
                    key, rid, UnloadLora(f"{message.request_id}.undo{i}", 0, name)
                )
        if not failed:
            self.adapter_changes.setdefault(key, {})[name] = path
            self._show_change(key, name, path)
        first = failed[0] if failed else answers[0]
        self._dispatch(replace(first, request_id=message.request_id))

    def _show_change(self, key: str, name: str, path: str | None) -> None:
        """Route by the change at once (the replicas' reports show it within a second or so)."""
        deployment = self.frontend.deployment(key)
        if deployment is None:
            return
        state = dict(deployment.shared.lora())
        adapters = [a for a in state.get("adapters", ()) if a.get("name") != name]
        if path is not None:
            adapters.append({"name": name, "path": path})
        deployment.shared.publish_lora({**state, "adapters": adapters, "updated_at": time.time()})

    async def _control_one(
        self, key: str, replica_id: str, message: LoadLora | UnloadLora
    ) -> RequestUpdate:
        assert self.loop is not None
        answer: asyncio.Future[RequestUpdate] = self.loop.create_future()
        self.controls[message.request_id] = answer
        try:
            for attempt in range(CONTROL_ATTEMPTS):
                try:
                    await settle(
                        self.handles[key].control.remote(
                            ReplicaProbe(replica_id), message, self.address
                        ),
                        LORA_CONTROL_TIMEOUT_S,
                    )
                    break
                except Exception as exc:
                    # the router handed the call to another replica, which refused it untouched
                    if MISROUTED not in str(exc) or attempt + 1 == CONTROL_ATTEMPTS:
                        raise
                    await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
            return await asyncio.wait_for(answer, FINAL_GRACE_S)
        except Exception as exc:
            return RequestUpdate(
                message.request_id,
                error=ErrorInfo(
                    503,
                    f"engine replica {replica_id} did not answer: {type(exc).__name__}",
                    code="replica_lost",
                    retry_after_s=1,
                ),
            )
        finally:
            self.controls.pop(message.request_id, None)


class RayLoadRequests(LoadRequests):
    """``Frontend.load_requests`` on the Ray host: a request waiting for an on-demand model
    wakes its deployment (``EngineHub.wake``) instead of the supervisor."""

    def __init__(self, hub: EngineHub) -> None:
        super().__init__(None)
        self.hub = hub

    def wake(self) -> None:
        self.hub.wake()
