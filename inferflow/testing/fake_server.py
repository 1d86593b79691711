"""A simulated OpenAI-compatible server with planted latencies, for testing load generators.

It serves ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models``,
``/version``, ``/health`` and ``/ready`` over real HTTP. ``/version`` names the served
checkpoint's folder, as inferflow's does, when ``checkpoint`` is set. Every streamed request: a chat ``role`` chunk at once,
then the first token after ``ttft_s``, each further token ``token_delay_s`` later (times
``1 + contention · (active streams - 1)``, a crude model of a shared batch), exactly ``max_tokens``
tokens (default ``default_tokens``), then — after ``tail_delay_s`` — the usage chunk (when asked
for and ``support_usage``) and ``[DONE]``. Sleeps only ever add time, so client-side figures can
never legitimately fall below the planted values.

Markers in the prompt (or any message) plant failures: ``[[http-500]]`` answers HTTP 500;
``[[error-event]]`` / ``[[error-data]]`` end the stream after half the tokens with an SSE
``event: error`` / a ``data: {"error": ...}`` chunk; ``[[truncate]]`` closes it after half the
tokens without ``finish_reason`` or ``[DONE]``.

``FakeServer`` runs it in a background thread on a socket bound before start (port 0 → free
port), so clients can connect as soon as the object exists. ``received`` lists what arrived
(headers and body), for tests to check what a client sent.
``python -m inferflow.testing.fake_server --port 8000 --ttft-ms 50`` runs it in the foreground.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeServerConfig:
    ttft_s: float = 0.05
    token_delay_s: float = 0.02
    default_tokens: int = 16
    tail_delay_s: float = 0.0
    contention: float = 0.0
    support_usage: bool = True
    model: str = "fake-model"
    checkpoint: str | None = None  # the folder name /version reports (None: it names none)


@dataclass
class ReceivedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    received_at: float  # time.perf_counter() when the handler started
    sent_at: list[float] = field(default_factory=list)  # perf_counter before each content chunk


class _State:
    """Mutable per-server state, owned by the server's event loop thread."""

    def __init__(self, config: FakeServerConfig) -> None:
        self.config = config
        self.active = 0
        self.peak_active = 0
        self.received: list[ReceivedRequest] = []


def _sse(obj: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj)}\n\n".encode()


def _chunk(chat: bool, text: str | None, finish: str | None, index: int) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if index == -1:
            delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]}


def _prompt_text(body: dict[str, Any]) -> str:
    if isinstance(body.get("messages"), list):
        return "\n".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    return str(body.get("prompt", ""))


async def _stream(state: _State, rec: ReceivedRequest, chat: bool, n: int) -> AsyncIterator[bytes]:
    cfg = state.config
    prompt = _prompt_text(rec.body)
    fail_at = (
        n // 2
        if any(m in prompt for m in ("[[error-event]]", "[[error-data]]", "[[truncate]]"))
        else None
    )
    state.active += 1
    state.peak_active = max(state.peak_active, state.active)
    try:
        if chat:
            yield _sse(_chunk(True, None, None, -1))
        await asyncio.sleep(cfg.ttft_s)
        for i in range(n):
            if i:
                await asyncio.sleep(cfg.token_delay_s * (1 + cfg.contention * (state.active - 1)))
            if fail_at is not None and i == fail_at:
                async for piece in _failure(prompt):
                    yield piece
                return
            rec.sent_at.append(time.perf_counter())
            last = i == n - 1
            yield _sse(_chunk(chat, f" tok{i}", "length" if last and not chat else None, i))
        if chat:
            yield _sse(_chunk(True, None, "length", n))
        await asyncio.sleep(cfg.tail_delay_s)
        options = rec.body.get("stream_options") or {}
        if cfg.support_usage and options.get("include_usage"):
            usage = {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": n,
                "total_tokens": len(prompt.split()) + n,
            }
            yield _sse({"id": "fake", "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
    finally:
        state.active -= 1


async def _failure(prompt: str) -> AsyncIterator[bytes]:
    error = {"message": "planted failure", "type": "InternalServerError", "code": 500}
    if "[[error-event]]" in prompt:
        yield _sse(error, event="error")
    elif "[[error-data]]" in prompt:
        yield _sse({"error": error})
    # [[truncate]]: nothing more — the response just ends.


def build_app(state: _State) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        rec = ReceivedRequest(request.url.path, dict(request.headers), body, time.perf_counter())
        state.received.append(rec)
        if "[[http-500]]" in _prompt_text(body):
            return JSONResponse({"error": {"message": "planted HTTP 500"}}, status_code=500)
        chat = request.url.path.endswith("chat/completions")
        n = int(
            body.get("max_tokens")
            or body.get("max_completion_tokens")
            or state.config.default_tokens
        )
        if body.get("stream"):
            return StreamingResponse(_stream(state, rec, chat, n), media_type="text/event-stream")
        return JSONResponse(await _complete(state, rec, chat, n))

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": state.config.model, "object": "model"}]}
        )

    async def version(request: Request) -> Response:
        cfg = state.config
        if cfg.checkpoint is None:
            return JSONResponse({"version": "fake"})  # vLLM's answer: no checkpoint named
        model = {"name": cfg.model, "path": cfg.checkpoint}
        return JSONResponse({"model": model, "models": [{"id": f"{cfg.model}@1", **model}]})

    async def ok(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/models", models),
            Route("/version", version),
            Route("/health", ok),
            Route("/ready", ok),
        ]
    )


async def _complete(state: _State, rec: ReceivedRequest, chat: bool, n: int) -> dict[str, Any]:
    cfg = state.config
    await asyncio.sleep(cfg.ttft_s + cfg.token_delay_s * max(n - 1, 0))
    text = "".join(f" tok{i}" for i in range(n))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    usage = {"prompt_tokens": len(_prompt_text(rec.body).split()), "completion_tokens": n}
    return {"id": "fake", "choices": [choice], "usage": usage}


class FakeServer:
    """The simulated server in a background thread; a context manager (``with FakeServer() as s``)."""

    def __init__(self, config: FakeServerConfig | None = None, port: int = 0) -> None:
        self.config = config or FakeServerConfig()
        self._state = _State(self.config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(128)  # connections queue in the backlog until uvicorn accepts them
        self.port = int(self._sock.getsockname()[1])
        uv = uvicorn.Config(
            build_app(self._state), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(uv)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name=f"fake-openai-{self.port}",
            daemon=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def received(self) -> list[ReceivedRequest]:
        return self._state.received

    @property
    def peak_active(self) -> int:
        """Most streams this server had open at once."""
        return self._state.peak_active

    def start(self) -> FakeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inferflow.testing.fake_server")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--token-delay-ms", type=float, default=20.0)
    p.add_argument("--tail-delay-ms", type=float, default=0.0)
    p.add_argument("--contention", type=float, default=0.0)
    p.add_argument("--default-tokens", type=int, default=16)
    p.add_argument("--no-usage", action="store_true")
    args = p.parse_args(argv)
    config = FakeServerConfig(
        args.ttft_ms / 1000,
        args.token_delay_ms / 1000,
        args.default_tokens,
        args.tail_delay_ms / 1000,
        args.contention,
        not args.no_usage,
    )
    server = FakeServer(config, port=args.port)
    print(f"fake OpenAI server on {server.url}", flush=True)
    server._server.run(sockets=[server._sock])  # foreground; Ctrl-C / SIGTERM stop it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
