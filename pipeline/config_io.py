"""Reading and writing config trees: loading YAML, dotted overrides, migrations of older
shapes, and the digest. Knows no section: it works on any tree of frozen dataclasses.

The sections live with the code that reads them (`pipeline.environments.config`,
`pipeline.sandbox.config`, `pipeline.paramserver.config`, `pipeline.storage.config`,
`pipeline.tasks.config`, `pipeline.tracking`, the central ones in `pipeline.config`),
and `pipeline.config.RunConfig` composes them. This module sits below all of them (it
imports none), so a section that needs coercion, or registers a migration of its own
older shape, imports it without closing an import loop.

A changed config shape is a function in `MIGRATIONS` for its section class (registered
by the module that defines the class), so a run's stored `config.json` keeps loading;
keys that moved between sections are listed in `MOVED_KEYS`, which the digest also reads
so that old runs keep resuming.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError

# Rewrites of a section's mapping from older or shorthand shapes into today's, by section
# class; `from_dict` applies them, so a run's config.json written by an earlier version
# keeps loading (and resuming: see `digest`). The module defining a section registers its
# own (`MIGRATIONS[TrainerConfig] = ...`).
MIGRATIONS: dict[type, Callable[[Mapping[str, Any]], dict[str, Any]]] = {}

# Keys that moved, old place -> today's: the family options once lived in the global task
# and SFT sections. Old configs (and config.json files) load through `move_keys`.
MOVED_KEYS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("task", "min_digits"): ("task", "arithmetic", "min_digits"),
    ("task", "max_digits"): ("task", "arithmetic", "max_digits"),
    ("task", "countdown_numbers"): ("task", "countdown", "numbers"),
    ("sft", "carry_drop_prob"): ("task", "arithmetic", "carry_drop_prob"),
    ("sft", "countdown_error_prob"): ("task", "countdown", "error_prob"),
}
_ABSENT = object()


def _pop_path(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    """Remove and return tree[path[0]][path[1]]...; drop sections left empty."""
    node = tree.get(path[0], _ABSENT)
    if len(path) == 1:
        return tree.pop(path[0], _ABSENT)
    if not isinstance(node, dict):
        return _ABSENT
    value = _pop_path(node, path[1:])
    if not node:
        del tree[path[0]]
    return value


def move_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """A run config mapping with the MOVED_KEYS in today's places (idempotent)."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for old, new in MOVED_KEYS.items():
        value = _pop_path(out, old)
        if value is _ABSENT:
            continue
        section = out.setdefault(new[0], {}).setdefault(new[1], {})
        if not isinstance(section, dict):
            raise ConfigError(f"{new[0]}.{new[1]} must be a mapping, got {section!r}")
        section = out[new[0]][new[1]] = dict(section)
        if new[2] in section and section[new[2]] != value:
            raise ConfigError(
                f"{'.'.join(old)}={value!r} (its old name) and {'.'.join(new)}="
                f"{section[new[2]]!r} disagree; set only {'.'.join(new)}"
            )
        section[new[2]] = value
    return out


def non_defaults(config: Any) -> dict[str, Any]:
    """{field: value} of a config's fields that differ from their default, nested sections
    as such dicts (omitted when nothing in them differs)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            if nested := non_defaults(value):
                out[f.name] = nested
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if value != default:
            out[f.name] = value
    return out


def digest(config: Any) -> str:
    """A hash of what a run config sets (stored in checkpoints, checked on resume).

    Over the fields whose value differs from their default only: a field added later
    with a default leaves the digest of every existing config unchanged, so runs
    created before it still resume. Moved keys are hashed where they were.
    """
    settings = non_defaults(config)
    for old, new in MOVED_KEYS.items():  # digested where they were: old runs resume
        value = _pop_path(settings, new)
        if value is not _ABSENT:
            settings.setdefault(old[0], {})[old[1]] = value
    blob = json.dumps(settings, sort_keys=True, default=list).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def legacy_digest(stored: Mapping[str, Any]) -> str:
    """The digest earlier versions wrote into checkpoints: a hash of every field of the
    config as stored in the run's config.json (before `RunConfig.digest` dropped defaults)."""
    blob = json.dumps(stored, sort_keys=True, default=list).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


_TYPE_WORDS = {int: "an integer", float: "a number"}


def coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=name + ".")
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            value = [value]
        (item_tp, _) = typing.get_args(tp)
        return tuple(coerce(v, item_tp, name) for v in value)
    if origin in (typing.Union, types.UnionType):
        return value
    if tp in (int, float) and isinstance(value, bool):
        # YAML's `steps: true` is a bool, and int(True) == 1: a typo, not a number.
        raise ConfigError(
            f"{name}={value!r} is invalid; allowed: {_TYPE_WORDS[tp]}, not true or false"
        )
    try:
        if tp is bool:
            if isinstance(value, str):
                low = value.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return low in ("true", "1", "yes")
            return bool(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            out = float(value)
            if math.isfinite(out):
                return out
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is invalid; allowed: a {tp.__name__}") from None
    if tp is float:  # .inf / .nan from YAML: no field means them
        raise ConfigError(f"{name}={value!r} is invalid; allowed: a finite number")
    return value


def optional_types(cls: type) -> dict[str, Any]:
    """{field: T} for the fields annotated `T | None` (their None is a sentinel)."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) == 1:
                out[name] = args[0]
    return out


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a (nested) mapping, rejecting unknown keys."""
    if cls in MIGRATIONS:
        data = MIGRATIONS[cls](data)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}'; allowed: {', '.join(names)}")
        kwargs[key] = coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def migrate(data: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """A (possibly older-shaped) mapping for `cls` in today's shape: the MIGRATIONS of
    `cls` and of its sections applied. Idempotent."""
    out = MIGRATIONS[cls](data) if cls in MIGRATIONS else dict(data)
    hints = typing.get_type_hints(cls)
    for key, value in out.items():
        tp = hints.get(key)
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            out[key] = migrate(value, tp)
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`["trainer.lr=3e-4", "task.families=arithmetic"]` -> nested dict."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw else "")
    return tree


def merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `extra` laid over it, section by section."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def override_section(section: Any, name: str, overrides: Iterable[str]) -> Any:
    """A config section (e.g. a run's `tracking`) with dotted `{name}.*` overrides applied;
    any other key is refused (`rlax track` sends a stored run elsewhere, nothing more)."""
    tree = parse_overrides(overrides)
    other = sorted(set(tree) - {name})
    if other:
        raise ConfigError(f"only {name}.* settings can be set here, got {', '.join(other)}")
    merged = merge(dataclasses.asdict(section), tree.get(name, {}))
    return from_dict(type(section), merged, prefix=f"{name}.")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds, or ConfigError naming the file and the fault."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (see configs/ for examples)")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at top level")
    return loaded


def load(
    cls: type,
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """Config `cls` from a YAML file, then a mapping (`extra`), then dotted overrides."""
    data: dict[str, Any] = {} if path is None else read_yaml(path)
    # Each layer in today's shape before merging, so that a later layer wins whichever
    # spelling (`trainer.kl_coef` or `trainer.loss.kl_coef`) each one uses.
    for layer in (extra or {}, parse_overrides(overrides)):
        data = merge(migrate(data, cls), migrate(layer, cls))
    return from_dict(cls, data)


def from_json(cls: type, text: str) -> Any:
    """Config `cls` from the JSON a run stored (by this or an earlier version)."""
    return from_dict(cls, json.loads(text))
