"""The admin role: ``server.admin_keys`` guard ``/admin/*``; an API key there is a 403.

Unit checks of ``ApiKeyAuth`` and the config first (every combination of keys), then the
limited server (API keys, ``k-main`` also an admin key, ``k-admin`` an admin key only, from
``$INFERFLOW_ADMIN_KEYS``) as a client sees it.
"""

from __future__ import annotations

import httpx
import pytest
from server_harness import LIMITED_ADMIN_KEY, MODEL, ServerProcess

import inferflow.server.http.limits as limits
from inferflow.config import ServerConfig
from inferflow.server.http.errors import OpenAIError
from inferflow.server.http.limits import ApiKeyAuth


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def refusal(check, headers: dict[str, str]) -> tuple[int, str, str | None]:
    with pytest.raises(OpenAIError) as info:
        check(headers)
    error = info.value.info
    return error.status_code, error.error_type, error.code


def test_admin_routes_take_only_admin_keys_when_both_kinds_are_set() -> None:
    auth = ApiKeyAuth(("user", "both"), ("root", "both"))
    assert auth.authorize_admin(bearer("root")) == "admin-0"
    assert auth.authorize_admin({"x-api-key": "both"}) == "admin-1"  # in both lists: admin here
    assert refusal(auth.authorize_admin, bearer("user")) == (
        403, "permission_error", "admin_key_required"
    )
    assert refusal(auth.authorize_admin, {})[0] == 401
    assert refusal(auth.authorize_admin, bearer("nobody"))[0] == 401
    # an admin key also opens the API routes, under its own rate-limit id
    assert auth.authenticate(bearer("root")) == "admin-0"
    assert auth.authenticate(bearer("both")) == "key-1"
    assert auth.key_ids == ["key-0", "key-1", "admin-0", "admin-1"]


def test_api_keys_without_admin_keys_close_the_admin_routes() -> None:
    auth = ApiKeyAuth(("user",))
    status, kind, code = refusal(auth.authorize_admin, bearer("user"))
    assert (status, kind, code) == (403, "permission_error", "admin_key_required")
    with pytest.raises(OpenAIError, match=r"set server\.admin_keys"):
        auth.authorize_admin(bearer("user"))
    assert refusal(auth.authorize_admin, {})[0] == 401
    assert auth.authenticate(bearer("user")) == "key-0"


def test_admin_keys_alone_guard_only_the_admin_routes() -> None:
    auth = ApiKeyAuth((), ("root",))
    assert auth.authenticate({}) == limits.OPEN_ACCESS  # no api_keys: the API stays open
    assert auth.authorize_admin(bearer("root")) == "admin-0"
    assert refusal(auth.authorize_admin, {})[0] == 401
    assert auth.key_ids == [limits.OPEN_ACCESS, "admin-0"]
    open_server = ApiKeyAuth(())
    assert open_server.authorize_admin({}) == limits.OPEN_ACCESS  # no key at all: open


def test_admin_keys_come_from_config_and_environment_and_empty_ones_are_refused() -> None:
    cfg = ServerConfig(api_keys=["a"], admin_keys=["r"])
    settings = cfg.with_env_api_keys(environ={"INFERFLOW_ADMIN_KEYS": " s, r ,a"})
    assert settings.admin_keys == ["r", "s", "a"] and settings.api_keys == ["a"]
    auth = ApiKeyAuth.for_server(settings)
    assert auth.authorize_admin(bearer("s")) == "admin-1"
    for name in ("api_keys", "admin_keys"):
        with pytest.raises(ValueError, match=f"^{name}: an empty key"):
            ServerConfig(**{name: ["ok", ""]})


@pytest.mark.server
def test_served_admin_routes_refuse_api_keys(limited_server: ServerProcess) -> None:
    routes = [
        ("GET", "/admin/stats", None),
        ("POST", f"/admin/models/{MODEL}/traffic", {"weights": {"1": 1}}),
        ("POST", f"/admin/models/{MODEL}/promote", {"version": "1"}),
    ]
    for method, path, body in routes:
        def call(key: str | None, method: str = method, path: str = path,
                 body: dict | None = body) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.request(method, limited_server.url(path), json=body, headers=headers,
                                 timeout=30)

        refused = call("k-rpm")  # an API key that is no admin key
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json()["error"]["type"] == "permission_error"
        assert refused.json()["error"]["code"] == "admin_key_required"
        assert call(None).status_code == 401, path
        assert call("wrong").status_code == 401, path
        for key in ("k-main", LIMITED_ADMIN_KEY):  # in both lists; admin only (environment)
            assert call(key).status_code == 200, (path, key, call(key).text)
    # the admin-only key may use the API too
    client = limited_server.client(api_key=LIMITED_ADMIN_KEY)
    assert client.models.list().data[0].id == MODEL
