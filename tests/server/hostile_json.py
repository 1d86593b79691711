"""Hypothesis strategies for request bodies carrying one hostile key at any depth.

A body is a valid request of its route with one key inserted into one of its objects, or into
an object nested up to three levels below it: a lone surrogate escape (``"\\ud800"``, not
Unicode text), a NUL, a 10 KB key, a key that looks like a number, or any short text. Bodies
are serialised with ``ensure_ascii`` so that a lone surrogate travels as the JSON escape a
client would send.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
from hypothesis import strategies as st

HOSTILE_KEYS = st.one_of(
    st.sampled_from([
        "\ud800", "\udfff", "a\udc00b", "\x00", "k\x00ey", "0", "-1", "1e5", "1.5", "NaN",
        "k" * 10_000, "\u2028", "model", "",
    ]),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF).map(lambda c: f"x{c}"),
    st.text(max_size=12),
)
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8),
    st.just({"\ud800": 1}), st.just([{"\x00": None}]),
)


def _objects(node: Any) -> list[dict[str, Any]]:
    """Every JSON object in ``node`` (itself included), depth first."""
    found: list[dict[str, Any]] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


@st.composite
def hostile_bodies(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """``valid`` with one hostile key at a drawn place (its objects, or new ones below)."""
    body = copy.deepcopy(valid)
    target = draw(st.sampled_from(_objects(body)))
    for _ in range(draw(st.integers(0, 3))):  # nest deeper under a fresh (short) key
        child: dict[str, Any] = {}
        target[draw(st.text(min_size=1, max_size=4))] = child
        target = child
    target[draw(HOSTILE_KEYS)] = draw(VALUES)
    return json.dumps(body, ensure_ascii=True).encode("ascii")


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a key or string of ``body`` is not Unicode text (a lone surrogate escape)."""
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def client_port(response: httpx.Response) -> int:
    """The local port of the connection ``response`` came on (same port: same connection)."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def check_answer(response: httpx.Response, what: bytes) -> None:
    """Not a server error; an error is OpenAI's JSON shape with a param that is safe text."""
    assert response.status_code < 500, (what[:300], response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, error
        assert len(response.content) < 16_384, "an error must not echo a large input"
        for text in (error["message"], error["param"] or ""):
            text.encode("utf-8")  # no lone surrogate made it into the answer
