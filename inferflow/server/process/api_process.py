"""One API process: a uvicorn server that drains instead of dropping requests.

Shutdown, driven by the supervisor (main process) with SIGTERM:

1. stop accepting: close the listening socket; requests on open keep-alive connections get 503;
2. let in-flight requests finish for up to ``grace_s`` seconds (a second SIGTERM skips the rest);
3. fail whatever is left explicitly — an SSE error event, or a 503 JSON body — never a silently
   truncated 200;
4. uvicorn's own shutdown (close connections, run the lifespan exit).

SIGINT is ignored here: Ctrl+C reaches the whole process group and the supervisor turns it into
the SIGTERM above, so every process follows one shutdown order.
"""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType

import uvicorn

from inferflow.server.http.frontend import Frontend
from inferflow.server.messages import QUEUE_LOST, ErrorInfo
from inferflow.server.process_utils import die_with_parent, name_process

logger = logging.getLogger(__name__)

FAIL_FLUSH_S = 5.0  # after failing in-flight requests, how long their error responses may take


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown drains ``frontend``'s in-flight requests first."""

    def __init__(self, config: uvicorn.Config, frontend: Frontend, grace_s: float) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.grace_s = grace_s
        self.hurry = False  # second SIGTERM: stop waiting for in-flight requests

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            return
        if self.should_exit:
            self.hurry = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        frontend = self.frontend
        frontend.draining = True
        for server in self.servers:
            server.close()  # stop accepting connections
        remaining = 0.0 if frontend.shared.queue_lost else self.grace_s  # nothing can finish
        while len(frontend.registry) and not self.hurry and remaining > 0:
            step = min(0.1, remaining)
            await frontend.registry.wait_idle(step)
            remaining -= step
        if len(frontend.registry):
            failed = frontend.registry.fail_all(
                QUEUE_LOST
                if frontend.shared.queue_lost
                else ErrorInfo(
                    503, "The server shut down before this request finished.", code="shutting_down"
                )
            )
            logger.warning(
                "shutdown: failed %d in-flight request(s) after the grace period", len(failed)
            )
            await frontend.registry.wait_idle(FAIL_FLUSH_S)
        self._captured_signals.clear()  # exit normally instead of re-raising SIGTERM
        await super().shutdown(sockets)


QUIET_PATHS = ("/health", "/ready", "/metrics")  # polled by orchestrators: no access log lines


class _QuietPolls(logging.Filter):
    """Drops uvicorn access-log lines of health, readiness and metrics polls."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else None
        return not (isinstance(path, str) and path.split("?", 1)[0] in QUIET_PATHS)


def run_api_process(server: DrainingServer, sockets: list[socket.socket]) -> None:
    """Entry point of a forked API process."""
    logging.getLogger("uvicorn.access").addFilter(_QuietPolls())
    die_with_parent(signal.SIGKILL)
    name_process(f"inferflow-api-{server.frontend.consumer_id}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # uvicorn installs its handler in serve()
    server.run(sockets=sockets)
