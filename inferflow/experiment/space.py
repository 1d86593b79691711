"""The search space of ``inferflow tune``: the knobs the config schema declares tunable.

Where the knobs come from (nothing is listed here):

- a slot's stage class: its fields declared with :func:`~inferflow.config.tunable.tunable`
  (``batching.max_num_seqs``, ``executor.precision``, ...), read from the class the slot's
  ``_target_`` names in the base config (a plugin's own stage declares its own knobs);
- the slot groups in ``stages.registry.TUNABLE_OPTIONS`` (``cache=prefix|none``,
  ``speculative=none|ngram``): the option is a knob, and the tunable fields of *each* option's
  class exist only when that option is chosen (define-by-run:
  ``speculative.num_speculative_tokens`` with ``speculative=ngram`` only);
- ``server``: the tunable fields of the server config (``server.num_api_servers``).

``--space KEY=LOW:HIGH[:log]`` / ``KEY=a,b,c`` / ``KEY`` (its declared range) narrows the
space to the keys given, with their ranges; a key nobody declared may be given too when the
composed config has it. :meth:`SearchSpace.suggest` draws a point from an Optuna trial,
:meth:`SearchSpace.grid` lists every point (categorical knobs and small integer ranges), and
:meth:`SearchSpace.overrides` turns a point into Hydra overrides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from inferflow.config import ConfigError
from inferflow.config.schema import SLOTS
from inferflow.config.server import RayServerConfig, ServerConfig
from inferflow.config.tunable import Tunable, tunables
from inferflow.stages.registry import BUILTIN_OPTIONS, TUNABLE_OPTIONS, UNMODELLED_OPTIONS

Point = dict[str, Any]  # knob key -> value (a group knob's value is the option name)
_ABSENT = object()


@dataclass(frozen=True)
class Knob:
    """One dimension: ``key`` (``batching.max_num_seqs``, or a slot group such as ``cache``),
    its range, and when it exists: ``options`` set means only while ``slot`` has one of them."""

    key: str
    spec: Tunable
    slot: str
    options: tuple[str, ...] | None = None
    group: bool = False

    def values(self, max_points: int = 16) -> list[Any]:
        """Every value of a categorical knob; an integer range's values (all of them when few,
        else powers of two within it and its ends)."""
        spec = self.spec
        if spec.choices:
            return list(spec.choices)
        low, high = int(spec.low or 0), spec.upper
        if high - low + 1 <= max_points:
            return list(range(low, high + 1))
        powers = [2**k for k in range(0, 31) if low <= 2**k <= high]
        return sorted({low, *powers, high})

    def default_of(self, base: DictConfig) -> Any:
        value = _select(base, self.key) if not self.group else None
        return getattr(value, "value", value)


def _select(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None)


def _class_of(node: Any) -> type | None:
    target = node.get("_target_") if isinstance(node, Mapping | DictConfig) else None
    if not target:
        return None
    from hydra.utils import get_class

    try:
        return get_class(str(target))
    except Exception:  # (an unimportable target: build_graph reports it, in one line)
        return None


def option_of(slot: str, cls: type | None) -> str | None:
    """The built-in option name whose class is ``cls`` (None: a plugin's class)."""
    for name, option_cls in BUILTIN_OPTIONS.get(slot, {}).items():
        if option_cls is cls:
            return name
    return None


@dataclass
class SearchSpace:
    """The knobs, in the order a point is drawn (a group before the fields it makes exist)."""

    knobs: list[Knob]
    base_options: dict[str, str | None]  # slot -> its option in the base config

    # ---------------------------------------------------------------- building it
    @classmethod
    def declared(cls, base: DictConfig) -> SearchSpace:
        """Every knob the schema declares for ``base`` (the composed base config)."""
        knobs: list[Knob] = []
        base_options: dict[str, str | None] = {}
        for slot in SLOTS:
            node = base.get(slot)
            base_cls = _class_of(node) if node is not None else None
            base_options[slot] = option_of(slot, base_cls)
            options = TUNABLE_OPTIONS.get(slot)
            if options:
                spec = Tunable(choices=options, simulated=slot not in UNMODELLED_OPTIONS)
                knobs.append(Knob(slot, spec, slot, group=True))
                having: dict[tuple[str, Tunable], list[str]] = {}
                for opt in options:  # a field several options share is one knob
                    for name, spec in tunables(BUILTIN_OPTIONS[slot][opt]).items():
                        having.setdefault((name, spec), []).append(opt)
                for (name, spec), opts in having.items():
                    where = None if len(opts) == len(options) else tuple(opts)
                    knobs.append(Knob(f"{slot}.{name}", spec, slot, options=where))
            elif base_cls is not None:
                for name, spec in tunables(base_cls).items():
                    knobs.append(Knob(f"{slot}.{name}", spec, slot))
        server = base.get("server")
        server_cls = (
            RayServerConfig
            if server is not None and str(server.get("runtime")) == "ray"
            else ServerConfig
        )
        for name, spec in tunables(server_cls).items():
            knobs.append(Knob(f"server.{name}", spec, "server"))
        return cls(knobs, base_options)

    def narrowed(self, specs: Sequence[str], base: DictConfig) -> SearchSpace:
        """Only the keys of ``--space`` items, with the ranges they give (see the module doc).
        Raises ConfigError (one line) for a bad item."""
        chosen: dict[str, Knob] = {}
        for item in specs:
            key, sep, text = item.partition("=")
            key = key.strip()
            if not key:
                raise ConfigError(
                    f"--space {item!r}: expected KEY=LOW:HIGH[:log], KEY=a,b,c or KEY"
                )
            known = [k for k in self.knobs if k.key == key]
            if sep:
                spec = parse_range(key, text)
                integer = known and known[0].spec.low is not None  # an integer knob
                if integer and any(type(c) is not int for c in spec.choices):
                    raise ConfigError(f"--space {key}={text}: expected integers")
                if known:  # (the range given; whether the model sees it stays declared)
                    found = [
                        dataclasses.replace(
                            k, spec=dataclasses.replace(spec, simulated=k.spec.simulated)
                        )
                        for k in known
                    ]
                else:
                    found = [self._undeclared(key, spec, base)]
            elif known:
                found = known
            else:
                raise ConfigError(
                    f"--space {key}: not a declared knob; give its range (KEY=LOW:HIGH or "
                    f"KEY=a,b,c); declared: {', '.join(sorted({k.key for k in self.knobs}))}"
                )
            if found[0].group:
                allowed = set(BUILTIN_OPTIONS.get(key, {}))
                bad = [c for c in found[0].spec.choices if allowed and str(c) not in allowed]
                if bad:
                    raise ConfigError(
                        f"--space {key}: unknown option {bad[0]}; available: "
                        f"{', '.join(sorted(allowed))}"
                    )
            for knob in found:
                chosen[f"{knob.key}@{knob.options}"] = knob
        space = SearchSpace([k for k in chosen.values()], dict(self.base_options))
        space.knobs.sort(
            key=lambda k: (
                list(SLOTS).index(k.slot) if k.slot in SLOTS else len(SLOTS),
                not k.group,
            )
        )
        for knob in space.knobs:  # a field of an option that can never be selected
            if knob.options is not None and not set(knob.options) & set(space.options(knob.slot)):
                need = "|".join(knob.options)
                raise ConfigError(
                    f"--space {knob.key}: exists with {knob.slot}={need} only; select it in "
                    f"the overrides, or give {knob.slot}=... in --space"
                )
        return space

    def _undeclared(self, key: str, spec: Tunable, base: DictConfig) -> Knob:
        """A key nobody declared tunable: a slot group, or a key the composed config has."""
        if "." not in key and (key in BUILTIN_OPTIONS or key in SLOTS):
            if not spec.choices:
                raise ConfigError(f"--space {key}: a config group takes options: {key}=a,b")
            spec = dataclasses.replace(spec, simulated=key not in UNMODELLED_OPTIONS)
            return Knob(key, spec, key, group=True)
        slot = key.split(".", 1)[0]
        if OmegaConf.select(base, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(f"--space {key}: the composed config has no such key")
        return Knob(key, spec, slot)

    def modelled(self) -> SearchSpace:
        """The knobs the engine model sees (``Tunable.simulated``): what the simulated search
        draws; the others keep the base's values there and are decided by real runs."""
        return SearchSpace([k for k in self.knobs if k.spec.simulated], dict(self.base_options))

    def unmodelled(self) -> list[Knob]:
        """The knobs only real runs decide (API processes, KV block size, speculation)."""
        return [k for k in self.knobs if not k.spec.simulated]

    # ---------------------------------------------------------------- using it
    def options(self, slot: str) -> list[str | None]:
        """The options ``slot`` may have in a point of this space."""
        group = next((k for k in self.knobs if k.group and k.slot == slot), None)
        return [str(c) for c in group.spec.choices] if group else [self.base_options.get(slot)]

    def active(self, knob: Knob, point: Mapping[str, Any]) -> bool:
        """Whether ``knob`` exists at ``point`` (its option is the one its slot has there)."""
        if knob.options is None:
            return True
        return str(point.get(knob.slot, self.base_options.get(knob.slot))) in knob.options

    def suggest(self, trial: Any) -> Point:
        """Draw a point from an Optuna trial, define-by-run."""
        point: Point = {}
        for knob in self.knobs:
            if not self.active(knob, point):
                continue
            spec = knob.spec
            if spec.choices:
                point[knob.key] = trial.suggest_categorical(knob.key, list(spec.choices))
            else:
                point[knob.key] = trial.suggest_int(
                    knob.key, int(spec.low or 0), spec.upper, log=spec.log and (spec.low or 0) > 0
                )
        return point

    def grid(self, max_points: int = 16) -> list[Point]:
        """Every point (define-by-run: an option's fields vary only where it is chosen)."""
        return list(self._grid(0, {}, max_points))

    def _grid(self, i: int, point: Point, max_points: int) -> Iterator[Point]:
        if i == len(self.knobs):
            yield dict(point)
            return
        knob = self.knobs[i]
        if not self.active(knob, point):
            yield from self._grid(i + 1, point, max_points)
            return
        for value in knob.values(max_points):
            point[knob.key] = value
            yield from self._grid(i + 1, point, max_points)
            del point[knob.key]

    def grid_size(self, max_points: int = 16) -> int:
        return sum(1 for _ in self._grid(0, {}, max_points))

    def contains(self, point: Mapping[str, Any]) -> bool:
        """Whether every value of ``point`` is in its knob's range."""
        for knob in self.knobs:
            if knob.key not in point:
                continue
            value, spec = point[knob.key], knob.spec
            if spec.choices:
                if str(value) not in {str(c) for c in spec.choices}:
                    return False
            elif not (isinstance(value, int) and (spec.low or 0) <= value <= spec.upper):
                return False
        return True

    def default_point(self, base: DictConfig) -> Point:
        """The base config's own values of the knobs (what ``enqueue_trial`` starts from)."""
        point: Point = {}
        for knob in self.knobs:
            if not self.active(knob, point):
                continue
            if knob.group:
                point[knob.key] = self.base_options.get(knob.slot)
            else:
                point[knob.key] = knob.default_of(base)
        return point

    @staticmethod
    def overrides(point: Mapping[str, Any]) -> list[str]:
        """Hydra overrides for ``point``: group options first, then values."""
        groups = [f"{k}={v}" for k, v in point.items() if "." not in k]
        values = [f"{k}={format_value(v)}" for k, v in point.items() if "." in k]
        return groups + values

    def describe(self) -> list[str]:
        """One line per knob: key, range, where it exists, whether the engine model sees it."""
        lines = []
        for knob in self.knobs:
            where = f" (with {knob.slot}={'|'.join(knob.options)})" if knob.options else ""
            sim = "" if knob.spec.simulated else " [measured only]"
            note = f"  # {knob.spec.note}" if knob.spec.note else ""
            lines.append(f"{knob.key}={knob.spec.describe()}{where}{sim}{note}")
        return lines


def format_value(value: Any) -> str:
    value = getattr(value, "value", value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def parse_range(key: str, text: str) -> Tunable:
    """``LOW:HIGH[:log]`` (integers) or ``a,b,c`` (config values; one value pins the key)."""
    text = text.strip()
    if not text:
        raise ConfigError(f"--space {key}=: empty range")
    if ":" in text and "," not in text:
        parts = text.split(":")
        log = len(parts) == 3 and parts[2] == "log"
        if len(parts) not in (2, 3) or (len(parts) == 3 and not log):
            raise ConfigError(f"--space {key}={text}: expected LOW:HIGH or LOW:HIGH:log")
        try:
            low, high = int(parts[0]), int(parts[1])
        except ValueError:
            raise ConfigError(f"--space {key}={text}: LOW and HIGH must be integers") from None
        if high < low:
            raise ConfigError(f"--space {key}={text}: HIGH < LOW")
        if log and low < 1:
            raise ConfigError(f"--space {key}={text}: a log range needs LOW >= 1")
        return Tunable(low=low, high=high, log=log)
    values = [_value(v.strip()) for v in text.split(",")]
    if any(v == "" for v in values):
        raise ConfigError(f"--space {key}={text}: an empty value")
    return Tunable(choices=tuple(dict.fromkeys(values)))


def _value(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, int | float | str | bool) else text
