"""``_target_`` resolution: the allowlist and building one stage from its config node.

``_target_`` is code execution, so only allowlisted modules are imported: ``inferflow.*``,
installed plugins (entry point group ``inferflow.plugins``), and prefixes the user opted into
(``allowed_targets=[...]`` or ``$INFERFLOW_ALLOWED_TARGETS``, comma-separated). The object found
must live in an allowed module too, and be the kind its slot needs (the slot's contract).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from inferflow.compose import discover_plugins
from inferflow.config.base import ConfigError, describe_omegaconf_error, keyed_error, stage_schema
from inferflow.stages.base import RequestStage
from inferflow.stages.engine_slot import EngineStage
from inferflow.stages.response import ResponseStage

META_KEYS = ("_target_", "after", "before")  # keys of a stage node that are not its config


# ---------------------------------------------------------------------- allowlist


def allowed_prefixes(
    cfg: DictConfig | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Module prefixes a ``_target_`` may come from."""
    env = (os.environ if environ is None else environ).get("INFERFLOW_ALLOWED_TARGETS", "")
    user = list(cfg.get("allowed_targets") or []) if cfg is not None else []
    plugins = [p.target_prefix for p in discover_plugins()]
    return [
        "inferflow",
        *plugins,
        *filter(None, (s.strip() for s in env.split(","))),
        *map(str, user),
    ]


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def locate_target(target: Any, where: str, prefixes: list[str]) -> Any:
    """Import ``target`` only if allowlisted; the object found must live in an allowed module too
    (so ``inferflow.some_module.os.system`` is refused)."""
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{where}._target_: must be a dotted import path, got {target!r}", where)
    if not _under(target, prefixes):
        raise ConfigError(
            f"{where}._target_={target} is not allowed: targets must come from "
            f"{', '.join(p + '.*' for p in prefixes)}; to trust it, install it as a plugin, pass "
            f"allowed_targets=[{target.rsplit('.', 1)[0]}] or set INFERFLOW_ALLOWED_TARGETS",
            f"{where}._target_",
        )
    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception as exc:
        raise ConfigError(
            f"{where}._target_={target} cannot be imported: {exc}".splitlines()[0]
        ) from None
    module = getattr(obj, "__module__", None) or ""
    if not _under(module, prefixes):
        raise ConfigError(
            f"{where}._target_={target} resolves to {module}, which is not allowed", where
        )
    return obj


def _check_nested_targets(node: Any, where: str, prefixes: list[str]) -> bool:
    """Refuse a nested ``_target_`` that is not allowlisted; whether ``node`` holds any."""
    found = False
    if isinstance(node, dict):
        if "_target_" in node:
            locate_target(node["_target_"], where, prefixes)
            found = True
        for key, value in node.items():
            found = _check_nested_targets(value, f"{where}.{key}", prefixes) or found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _check_nested_targets(value, f"{where}[{i}]", prefixes) or found
    return found


# ---------------------------------------------------------------------- instantiation


def instantiate_stage(
    node: DictConfig, where: str, kind: type | tuple[type, ...], prefixes: list[str]
) -> Any:
    """Build one stage from its node, giving it only its own keys (validated against the
    class's dataclass fields when it has them)."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(f"{where}: needs a _target_ (got {node!r})", where)
    cls = locate_target(node._target_, where, prefixes)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not (isinstance(cls, type) and issubclass(cls, kinds)):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{where}._target_={node._target_} is not a {wanted} subclass", where)
    slot_kind = getattr(cls, "kind", "")
    if issubclass(cls, EngineStage) and slot_kind and slot_kind != where:
        raise ConfigError(
            f"{where}._target_={node._target_} fills the {slot_kind} slot, not {where}", where
        )
    if issubclass(cls, EngineStage) and hasattr(cls, "contribute"):
        raise ConfigError(
            f"{where}._target_={node._target_} implements contribute(), which inferflow no "
            f"longer calls: implement the {kinds[0].__name__} contract (docs/writing_a_plugin.md)",
            where,
        )
    params = {k: v for k, v in node.items() if k not in META_KEYS}
    try:
        if dataclasses.is_dataclass(cls):
            typed = OmegaConf.merge(OmegaConf.structured(stage_schema(cls)), params)
            assert isinstance(typed, DictConfig)
            params = {k: typed[k] for k in params}
        container = OmegaConf.to_container(OmegaConf.create(params), resolve=True)
    except OmegaConfBaseException as exc:
        raise describe_omegaconf_error(exc, prefix=f"{where}.") from None
    assert isinstance(container, dict)
    kwargs: dict[str, Any] = {str(k): v for k, v in container.items()}
    nested = _check_nested_targets(kwargs, where, prefixes)
    try:
        if nested:
            from hydra.utils import instantiate

            kwargs = {k: instantiate(v, _convert_="all") if isinstance(v, dict | list) else v
                      for k, v in kwargs.items()}  # (a scalar setting is not a config)
        stage = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise keyed_error(where, exc, set(kwargs)) from None
    if isinstance(stage, RequestStage | ResponseStage):
        stage.name = where.rsplit(".", 1)[-1]
    return stage
