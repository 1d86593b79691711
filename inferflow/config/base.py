"""Config utilities every schema shares: the enum type of a config choice, the one-line
``ConfigError``, building a typed config from a node, and memory sizes (``4GiB``, ``auto/N``).

Leaf module: imports nothing of inferflow.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from enum import Enum
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)


class ConfigEnum(str, Enum):
    """A config choice that behaves as its plain string value (``str()``, f-strings, ``==``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ConfigError(ValueError):
    """A config problem the user can fix; ``str()`` is one line naming the key (exit code 2)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ---------------------------------------------------------------- typed configs


def target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def stage_schema(cls: type, target: str | None = None) -> type:
    """A dataclass with ``_target_`` (default: ``cls``'s import path) + ``cls``'s init fields,
    types resolved, so OmegaConf can check values and reject unknown keys."""
    target_field = dataclasses.field(default=target or target_of(cls))
    specs: list[tuple[str, Any, Any]] = [("_target_", str, target_field)]
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = dataclasses.field(default=f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = dataclasses.field(default_factory=f.default_factory)
            else:
                default = dataclasses.field(default=MISSING)
            specs.append((f.name, hints[f.name], default))
    schema = dataclasses.make_dataclass(f"{cls.__name__}Schema", specs)
    schema.__module__ = cls.__module__
    return schema


def typed_config(schema: type, node: Any, key: str) -> Any:
    """``node`` checked against the dataclass ``schema`` and built as one; a bad value or key is
    a ConfigError naming ``key.field``."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node if node is not None else {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise describe_omegaconf_error(exc, prefix=f"{key}.") from None
    except ValueError as exc:  # a schema's __post_init__ range check
        raise keyed_error(key, exc, {f.name for f in dataclasses.fields(schema)}) from None


def keyed_error(where: str, exc: Exception, names: set[str]) -> ConfigError:
    """``ValueError("max_num_seqs: must be >= 1")`` -> ``batching.max_num_seqs: must be >= 1``."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if message.startswith(f"{where}."):  # already names the full key
        return ConfigError(message, message.partition(": ")[0])
    head, sep, rest = message.partition(": ")
    if sep and head in names:
        return ConfigError(f"{where}.{head}: {rest}", f"{where}.{head}")
    return ConfigError(f"{where}: {message}", where)


# ---------------------------------------------------------------- one-line error messages

_CONVERT = re.compile(r"Value '(.*)' of type '.*' could not be converted to (\w+)")
_ENUM = re.compile(r"Invalid value '(.*)', expected one of \[(.*)\]")
_EXPECTED = {
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "String": "a string",
}


def describe_omegaconf_error(exc: OmegaConfBaseException, prefix: str = "") -> ConfigError:
    """One line naming the key and what is allowed, from an OmegaConf validation/key error."""
    full_key = f"{prefix}{getattr(exc, 'full_key', None) or ''}".rstrip(".") or "config"
    first = str(getattr(exc, "msg", None) or exc).splitlines()[0]
    if m := _ENUM.match(first):
        return ConfigError(f"{full_key}: invalid value '{m[1]}'; allowed values: {m[2]}", full_key)
    if m := _CONVERT.match(first):
        expected = _EXPECTED.get(m[2], m[2].lower())
        return ConfigError(f"{full_key}: invalid value '{m[1]}'; expected {expected}", full_key)
    if isinstance(exc, ConfigKeyError | ConfigAttributeError) and first.startswith("Key "):
        parent = getattr(exc, "parent_node", None)
        keys = [k for k in parent if k != "hydra"] if isinstance(parent, DictConfig) else []
        allowed = f"; allowed keys: {', '.join(map(str, keys))}" if keys else ""
        if (
            isinstance(parent, DictConfig)
            and OmegaConf.get_type(parent) is dict
            and "." in full_key
        ):
            allowed += f" (to add a key to this dict: +{full_key}=VALUE)"
        return ConfigError(f"{full_key}: unknown key{allowed}", full_key)
    if isinstance(exc, MissingMandatoryValue):
        return ConfigError(f"{full_key}: a value is required (pass {full_key}=...)", full_key)
    return ConfigError(f"{full_key}: {first}", full_key)


# ---------------------------------------------------------------- memory sizes

AUTO = "auto"
# k, m, g, t (and kb, mb, ...) count in powers of 1000; kib, mib, gib, tib in powers of 1024
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base**power
    for power, prefix in enumerate("kmgt", 1)
    for suffix, base in (("", 1000), ("b", 1000), ("ib", 1024))
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def auto_share(value: str | int | None) -> int | None:
    """N for ``auto`` (1), ``auto/N`` or unset (1); None for an explicit size."""
    if value is None:
        return 1
    text = str(value).strip().lower()
    if text in ("", AUTO):
        return 1
    match = re.fullmatch(r"auto\s*/\s*([0-9]+)", text)
    if match is None:
        return None
    if int(match.group(1)) < 1:
        raise ValueError(f"executor.kv_cache_memory: {value!r}: N of auto/N must be >= 1")
    return int(match.group(1))


def parse_memory(value: str | int | None, field: str = "executor.kv_cache_memory") -> int | None:
    """Bytes from ``4GiB``, ``512MB``, ``1073741824`` ...; None for ``auto``, ``auto/N`` (or
    unset)."""
    kv = field.endswith("kv_cache_memory")
    if value is None or (kv and auto_share(value) is not None):
        return None
    if isinstance(value, int):
        amount, unit = float(value), ""
    else:
        match = _SIZE.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{field}: {value!r} is not a size (e.g. 4GiB, 512MiB, 1073741824"
                f"{' or auto' if kv else ''})"
            )
        amount, unit = float(match.group(1)), match.group(2).lower()
    size = int(amount * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{field}: must be > 0, got {value!r}")
    return size
