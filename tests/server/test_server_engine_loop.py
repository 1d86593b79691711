"""EngineLoop on a real LLMEngine (tiny model, in process): its threads, cancels and deadlines.

The loop runs exactly as in a LitServe worker (``run_worker`` on its own thread), fed
through a ``queue.Queue`` standing in for the Manager queue; what it sends is recorded by a
transport that keeps messages in order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import pytest

from inferflow import LLM
from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.tiny import tiny_llama_path
from inferflow.sampling_params import SamplingParams
from inferflow.server.litserve.engine_api import run_worker
from inferflow.server.messages import (
    CancelRequest,
    ErrorInfo,
    RequestUpdate,
    StopWorker,
    SubmitRequest,
    UpdateBatch,
)
from inferflow.server.shared_state import SharedState
from inferflow.server.worker.service import WorkerService

WAIT_S = 60.0


class RecordingTransport:
    """Keeps every sent message; ``wait_for`` blocks until a predicate over them holds."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []
        self._cond = threading.Condition()

    def send(self, item: object, consumer_id: int) -> None:
        with self._cond:
            self.sent.append((consumer_id, item))
            self._cond.notify_all()

    def updates(self, request_id: str) -> list[RequestUpdate]:
        with self._cond:
            return [
                u
                for _, m in self.sent
                if isinstance(m, UpdateBatch)
                for u in m.updates
                if u.request_id == request_id
            ]

    def wait_final(self, request_id: str) -> list[RequestUpdate]:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(u.final for u in self._unlocked(request_id)), WAIT_S
            )
        assert ok, f"no final update for {request_id}"
        return self.updates(request_id)

    def wait_any(self, request_id: str) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._unlocked(request_id), WAIT_S)

    def _unlocked(self, request_id: str) -> list[RequestUpdate]:
        return [
            u
            for _, m in self.sent
            if isinstance(m, UpdateBatch)
            for u in m.updates
            if u.request_id == request_id
        ]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLM(tiny_llama_path(), max_slots=4, max_model_len=256).engine


class Running:
    """An EngineLoop running on a thread, as inside the worker process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.shared = SharedState()
        self.service = WorkerService(lambda wrap=None: engine, self.shared)
        self.service.engine = engine
        self.requests: queue.Queue = queue.Queue()
        self.transport = RecordingTransport()
        self.thread = threading.Thread(
            target=run_worker, args=(self.service, self.requests, self.transport), daemon=True
        )
        self.thread.start()

    def submit(
        self, rid: str, prompt: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> None:
        now = time.time()
        deadline = now + timeout_s if timeout_s is not None else None
        self.requests.put(SubmitRequest(rid, 0, prompt, params, now, deadline))

    def stop(self) -> None:
        self.requests.put(StopWorker(ErrorInfo(503, "stopping", code="shutting_down")))
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()

    def wait_stats(self, predicate) -> dict:
        deadline = time.monotonic() + WAIT_S
        while not predicate(stats := self.shared.stats()):
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
        return stats


@pytest.fixture
def running(engine: LLMEngine) -> Iterator[Running]:
    loop = Running(engine)
    yield loop
    if loop.thread.is_alive():
        loop.stop()


def prompt_ids(engine: LLMEngine, text: str = "Once upon a time") -> list[int]:
    return engine.tokenizer.encode(text)


def test_streamed_deltas_add_up_to_the_offline_output(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=9, temperature=0.0)
    engine.add_request("offline", prompt_ids(engine), params)
    offline = None
    while engine.has_unfinished_requests():  # before any loop thread drives this engine
        for out in engine.step():
            offline = out if out.finished else offline
    running = Running(engine)
    running.submit("r1", prompt_ids(engine), params)
    updates = running.transport.wait_final("r1")
    assert "".join(u.text for u in updates) == offline.outputs[0].text
    final = updates[-1]
    assert (final.finish_reason, final.completion_tokens) == ("length", 9)
    assert final.prompt_tokens == len(prompt_ids(engine))
    assert sum(1 for u in updates if u.final) == 1
    assert running.shared.ready
    running.stop()


def test_cancel_frees_the_slot_before_the_next_step(engine: LLMEngine, running: Running) -> None:
    running.submit(
        "long", prompt_ids(engine), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    )
    running.transport.wait_any("long")
    running.requests.put(CancelRequest("long", "client_disconnected"))
    stats = running.wait_stats(lambda s: s["aborted_requests"] == 1)
    assert stats["running"] == 0 and stats["free_slots"] == stats["total_slots"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not any(u.final for u in running.transport.updates("long"))  # nobody listens: no final


def test_deadline_aborts_with_a_504(engine: LLMEngine, running: Running) -> None:
    running.submit(
        "slow",
        prompt_ids(engine),
        SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True),
        timeout_s=0.05,
    )
    final = running.transport.wait_final("slow")[-1]
    assert final.error is not None and final.error.status_code == 504
    stats = running.wait_stats(lambda s: s["timed_out_requests"] == 1)
    assert stats["running"] == 0


def test_rejected_prompt_gets_a_400_naming_the_field(engine: LLMEngine, running: Running) -> None:
    running.submit("huge", [1] * 300, SamplingParams(max_tokens=1))
    error = running.transport.wait_final("huge")[-1].error
    assert error is not None and (error.status_code, error.param) == (400, "prompt")


def test_stop_fails_what_is_running_and_ends_the_loop(engine: LLMEngine, running: Running) -> None:
    running.submit(
        "victim",
        prompt_ids(engine),
        SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True),
    )
    running.transport.wait_any("victim")
    running.stop()
    final = running.transport.updates("victim")[-1]
    assert final.error is not None and final.error.code == "shutting_down"
    assert engine.stats().num_running == 0
