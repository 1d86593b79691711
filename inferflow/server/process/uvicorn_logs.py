"""uvicorn's log configuration, without its claims that the server is up.

uvicorn logs "Uvicorn running on http://..." when the listening socket is bound and "Application
startup complete." when an API process starts: both come before the engine worker has loaded
the model, seconds or minutes before ``/ready`` turns 200. The line that says the server is up,
and where, is ours (``runtime.start_line``, printed by the supervisor once every eager model
settled). uvicorn's start records are demoted to DEBUG (shown with ``server.log_level=debug``);
every other record, warnings and errors included, passes unchanged.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from uvicorn.config import LOGGING_CONFIG

# uvicorn's format strings (config.bind_socket, Server._log_started_message, Server.serve,
# LifespanOn.startup), matched on the unformatted message so arguments cannot fake a match
START_MESSAGES = (
    "Uvicorn running on",
    "Started server process",
    "Waiting for application startup",
    "Application startup complete",
)


class DemoteStartMessages(logging.Filter):
    """Turns uvicorn's start records into DEBUG records, dropped unless DEBUG is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(START_MESSAGES)):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's default ``log_config`` with the start records demoted.

    The filter sits on the ``default`` handler (the ``uvicorn`` and ``uvicorn.error`` records),
    not on a logger: ``dictConfig`` recreates handlers on every ``uvicorn.Config`` but only ever
    adds logger filters, so a logger filter would pile up once per API process.
    """
    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"demote_start": {"()": DemoteStartMessages}}
    config["handlers"]["default"]["filters"] = ["demote_start"]
    return config
