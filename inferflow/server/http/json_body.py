"""Reading a request body as JSON, whatever the bytes: anything unusable is a 400 naming it.

``json.loads`` alone lets three kinds of hostile bodies through as server errors: nesting deep
enough to exhaust the recursion limit, integer literals past Python's 4,300-digit limit, and
strings holding lone surrogates (valid JSON escapes such as ``"\\ud800"`` that are not Unicode
text and break every later ``encode``). :func:`parse_json_body` turns each into a 400: the
whole body is named for malformed JSON, the offending field for a bad string or key (at any
depth; the path quotes each key safely: ``errors.field_name``). A client that hangs up while
sending the body is one debug line and a 499 nobody reads, not a traceback.
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from starlette.requests import ClientDisconnect

from inferflow.json_types import JSONValue
from inferflow.server.http.errors import CLIENT_CLOSED, OpenAIError, bad_request, field_name

logger = logging.getLogger(__name__)

MAX_DEPTH = 32  # no OpenAI request nests deeper than a handful of levels


def parse_json_body(raw: bytes) -> JSONValue:
    """The body's JSON value; raises a 400 ``OpenAIError`` for anything unusable."""
    try:
        value: JSONValue = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None) from None
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels", None) from None
    except ValueError as exc:  # e.g. an integer literal of thousands of digits
        raise bad_request(f"the request body has an unusable value: {exc}", None) from None
    _check(value)
    return value


async def read_json_body(request: Request) -> JSONValue:
    try:
        raw = await request.body()
    except ClientDisconnect:
        logger.debug("client disconnected while sending the body of %s", request.url.path)
        raise OpenAIError(CLIENT_CLOSED) from None
    return parse_json_body(raw)


def _check(value: JSONValue) -> None:
    """Depth and Unicode of every string (iteratively: the depth is what is being checked)."""
    stack: list[tuple[JSONValue, str, int]] = [(value, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels", None)
        if isinstance(node, str):
            _check_text(node, where)
        elif isinstance(node, dict):
            for key, item in node.items():
                path = f"{where}.{field_name(key)}" if where else field_name(key)
                _check_text(key, path, "key")
                stack.append((item, path, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(node))


def _check_text(text: str, where: str, what: str = "string") -> None:
    """``where`` is already safe to quote (``field_name``), ``text`` may not be."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{where or 'the request body'}: the {what} is not valid Unicode (it holds a lone "
            "surrogate escape such as \\ud800)",
            where or None,
        ) from None
