"""Configs as text: JSON trees, and `--section.field=value` command-line overrides.

Overrides come as `--model.d_model=256`; `--model=llama3_8b` swaps in a whole
registered preset first, so `--model=gemma2_2b --model.n_layers=2` works, and
`--grpo=dapo` a GRPO preset. The sections a job reads are printed and saved
as JSON at the start of every run (`dumps` / `save`); `from_dict` reads them
back, filling missing sections and fields with their defaults.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing
from typing import Any, Literal

from ptx import paths
from ptx.config import GRPO_PRESETS, Config, ConfigError
from ptx.model_config import MODEL_PRESETS


def to_dict(cfg: Any, sections: tuple[str, ...] | None = None) -> dict[str, Any]:
  """Returns the config tree as plain JSON-able dicts (only `sections` of a Config, when given)."""
  tree = dataclasses.asdict(cfg)
  return tree if sections is None else {k: v for k, v in tree.items() if k in sections}


def dumps(cfg: Any, sections: tuple[str, ...] | None = None) -> str:
  """Returns the config tree (or its `sections`) as indented JSON, as a run's config.json holds it."""
  return json.dumps(to_dict(cfg, sections), indent=2, sort_keys=False)


def fields(cfg: Any, sections: tuple[str, ...] | None = None, *, changed_only: bool = False) -> list[str]:
  """`section.field=value` (the value as JSON) for every field of `cfg` (or its `sections`), in declaration order.

  With `--` before it, each line is an override `apply_overrides` takes back as it stands, so the lines are the
  config as command-line words (`ptx sft --fields`).

  Args:
    cfg: a config tree (a Config, or one of its sections' dataclasses).
    sections: the top-level fields to list (all when None).
    changed_only: list only the fields whose value is not the default's: what a start-up prints, the choices of
      this run in a few lines, where the whole tree (config.json) is hundreds.
  """
  ours, defaults = to_dict(cfg, sections), to_dict(type(cfg)(), sections)
  out = []

  def walk(prefix: str, mine: Any, default: Any) -> None:
    if isinstance(mine, dict) and isinstance(default, dict):  # a section (a dataclass that is one by default)
      for key, value in mine.items():
        walk(f"{prefix}.{key}" if prefix else key, value, default.get(key))
    elif not changed_only or mine != default:
      out.append(f"{prefix}={json.dumps(mine)}")

  walk("", ours, defaults)
  return out


def save(cfg: Any, path: str | pathlib.Path, sections: tuple[str, ...] | None = None) -> None:
  """Writes the config tree (or its `sections`; `from_dict` fills the others with defaults) as JSON to `path`."""
  paths.path(path).write_text(dumps(cfg, sections) + "\n")


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
  """Builds dataclass `cls` from nested dicts (the inverse of `to_dict`).

  Raises:
    ConfigError: naming the dotted field for unknown keys or wrongly typed values.
  """
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, value in data.items():
    name = f"{where}{key}"
    if key not in fields:
      raise ConfigError(f"unknown config field {name!r}; {cls.__name__} has {sorted(fields)}")
    kwargs[key] = _coerce(hints[key], value, name)
  return cls(**kwargs)


def apply_overrides(cfg: Config, args: list[str]) -> Config:
  """Applies `--a.b=value` overrides (and `--model=PRESET`, `--grpo=PRESET`) in order.

  A preset replaces its whole section where it stands on the line. The field overrides between two presets are
  applied together, so their order does not matter (`--data.kind=rl --data.pack=false` is `--data.pack=false
  --data.kind=rl`) and each config class checks its fields once, with all of them set; a field given twice takes
  its last value, and a section given whole (`--data={...}`) takes its sub-field overrides on top.

  Args:
    cfg: the starting config.
    args: command-line words, each `--dotted.field=value`.

  Returns:
    The new config; `cfg` is unchanged.

  Raises:
    ConfigError: naming the argument for unknown fields, presets or bad values.
  """
  pending: dict[tuple[str, ...], str] = {}
  for arg in args:
    if not arg.startswith("--") or "=" not in arg:
      raise ConfigError(f"override {arg!r} is not of the form --field.path=value")
    path, raw = arg[2:].split("=", 1)
    if path in ("grpo", "model") and pending:
      cfg, pending = _replace_fields(cfg, pending), {}
    if path == "grpo":
      if raw not in GRPO_PRESETS:
        raise ConfigError(f"unknown GRPO preset {raw!r}; known: {sorted(GRPO_PRESETS)}")
      cfg = dataclasses.replace(cfg, grpo=GRPO_PRESETS[raw])
    elif path == "model":
      if raw not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {raw!r}; known: {sorted(MODEL_PRESETS)}")
      cfg = dataclasses.replace(cfg, model=MODEL_PRESETS[raw]())
    else:
      pending.pop(tuple(path.split(".")), None)  # a repeated field takes its place (and value) at its last mention
      pending[tuple(path.split("."))] = raw
  return _replace_fields(cfg, pending) if pending else cfg


def _replace_fields(node: Any, changes: dict[tuple[str, ...], str], prefix: str = "") -> Any:
  """`node` with every change applied (keys: field paths below `node`, values: their raw strings), in one replace."""
  named = ", ".join(f"--{prefix}{'.'.join(keys)}" for keys in changes)
  if not dataclasses.is_dataclass(node):
    raise ConfigError(f"{named}: {type(node).__name__} has no sub-fields")
  fields = {f.name for f in dataclasses.fields(node)}
  hints = typing.get_type_hints(type(node))
  replaced = {}
  for name in dict.fromkeys(keys[0] for keys in changes):
    path = f"{prefix}{name}"
    if name not in fields:
      raise ConfigError(f"--{path}: unknown field {name!r}; {type(node).__name__} has {sorted(fields)}")
    value = _parse(hints[name], changes[(name,)], path) if (name,) in changes else getattr(node, name)
    below = {keys[1:]: raw for keys, raw in changes.items() if keys[0] == name and len(keys) > 1}
    replaced[name] = _replace_fields(value, below, f"{path}.") if below else value
  try:
    return dataclasses.replace(node, **replaced)
  except ValueError as e:  # a config class's own check (__post_init__), on all of its fields set at once
    raise ConfigError(f"{named}: {e}") from e


def _parse(hint: Any, raw: str, path: str) -> Any:
  """Parses a command-line string into the field's declared type."""
  if raw in _literal_strings(hint):  # "none" is an option of some fields (grpo.kl_placement), not None
    return raw
  try:
    value = json.loads(raw)
  except json.JSONDecodeError:
    value = raw  # bare strings: --model.activation=silu
  if raw.lower() in ("none", "null"):
    value = None
  elif raw.lower() in ("true", "false"):
    value = raw.lower() == "true"
  return _coerce(hint, value, path)


def _literal_strings(hint: Any) -> set[str]:
  """The strings a Literal field (optional or not) admits; empty for other types."""
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return set().union(*(_literal_strings(option) for option in typing.get_args(hint)))
  if origin is Literal:
    return {v for v in typing.get_args(hint) if isinstance(v, str)}
  return set()


def _coerce(hint: Any, value: Any, path: str) -> Any:
  """Checks `value` against type `hint`, converting where lossless."""
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    errors = []
    for option in typing.get_args(hint):
      try:
        return _coerce(option, value, path)
      except ConfigError as e:
        errors.append(str(e))
    raise ConfigError(f"{path}: {value!r} matches none of {hint}")
  if hint is type(None):
    if value is None:
      return None
    raise ConfigError(f"{path}: expected None, got {value!r}")
  if origin is Literal:
    if value in typing.get_args(hint):
      return value
    raise ConfigError(f"{path}: {value!r} is not one of {typing.get_args(hint)}")
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{path}: expected a list, got {value!r}")
    (item,) = typing.get_args(hint)[:1]
    return tuple(_coerce(item, v, path) for v in value)
  if dataclasses.is_dataclass(hint):
    if isinstance(value, hint):
      return value
    if isinstance(value, dict):
      return from_dict(hint, value, f"{path}.")
    raise ConfigError(f"{path}: expected a {hint.__name__} object, got {value!r}")
  if hint is bool:
    if isinstance(value, bool):
      return value
  elif hint is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif hint is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif hint is str:
    if isinstance(value, str):
      return value
  else:
    raise ConfigError(f"{path}: unsupported field type {hint}")
  raise ConfigError(f"{path}: expected {hint.__name__}, got {value!r}")
