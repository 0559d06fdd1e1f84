"""The tuning table's schema: keys, decisions, config <-> JSON, validation.

The table itself (which file, lookup, merge) is `pallas_rs.tuning`; its format is described
there.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Mapping, NamedTuple

# pallas_rs.kernel.config (and with it the Mosaic GPU import chain) is imported on first use, so that
# `import pallas_rs` stays light.

SCHEMA_VERSION = 1
CHOICES = ("fused", "xla")  # What an entry or a decision picks; api.IMPLEMENTATIONS adds "auto".
OPS = ("matmul_rs", "ag_matmul")
DEFAULT_OP = "matmul_rs"
SOURCES = ("table", "heuristic", "default")
MODES = ("single_gpu", "multi_gpu", "loopback")
INFORMATIONAL_MODES = ("loopback",)

_KEY_FIELDS = {"gpu_kind": str, "num_devices": int, "m": int, "n": int,
               "k_shard": int, "dtype": str}
_ENTRY_FIELDS = {"key", "op", "implementation", "config", "times_us", "env",
                 "measured_with", "mode", "fallback"}
_REQUIRED_ENTRY_FIELDS = {"key", "implementation", "config", "times_us"}

class Key(NamedTuple):
  """Lookup key of a tuning-table entry."""
  gpu_kind: str
  num_devices: int
  m: int
  n: int
  k_shard: int
  dtype: str

  def normalized(self) -> Key:
    return self._replace(gpu_kind=norm_kind(self.gpu_kind))


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the table says for one shape (`tuning.select`), and why.

  Attributes:
    implementation: "fused" or "xla".
    config: the kernel config for this shape: the one to run if
      implementation is "fused"; for "xla", the config the fused path would use
      if forced (None where the kernel cannot take the shape).
    source: "table" (exact entry), "heuristic" (nearest measured m),
      or "default" (no usable measurement).
    reason: one line for logs, naming the key and the evidence.
  """
  implementation: str
  config: Any
  source: str
  reason: str

  def __post_init__(self):
    if self.implementation not in CHOICES:
      raise ValueError(f"implementation={self.implementation!r} must be one of "
                       f"{CHOICES}")
    if self.source not in SOURCES:
      raise ValueError(f"source={self.source!r} must be one of {SOURCES}")
    if self.implementation == "fused" and self.config is None:
      raise ValueError("a 'fused' decision needs a config")


def _config_codec(op: str):
  """(to_json, from_json) of the config type of `op`."""
  if op == "ag_matmul":
    from pallas_rs.kernel import ag_matmul  # pylint: disable=g-import-not-at-top
    return ag_matmul.config_to_json, ag_matmul.config_from_json
  return config_to_json, config_from_json


# ---------------------------------------------------------------------------
# Config <-> JSON.
# ---------------------------------------------------------------------------


_DIMENSION_FIELDS = ("grid_minor_dim", "wg_dimension")


def config_to_json(cfg) -> dict[str, Any]:
  """All Config fields; grid_minor_dim and wg_dimension by name ("M" or "N")."""
  out = dataclasses.asdict(cfg)
  for name in _DIMENSION_FIELDS:
    out[name] = getattr(cfg, name).name
  return out


def config_from_json(obj: Mapping[str, Any]):
  """Inverse of `config_to_json` (a `pallas_rs.Config`); ValueError on unknown fields or bad
  values."""
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  config_fields = tuple(f.name for f in dataclasses.fields(config_lib.Config))
  if not isinstance(obj, Mapping):
    raise ValueError(f"config must be an object, got {type(obj).__name__}")
  unknown = sorted(set(obj) - set(config_fields))
  if unknown:
    raise ValueError(f"unknown config fields {unknown}; known: {list(config_fields)}")
  kw = dict(obj)
  for name, value in kw.items():
    if name in _DIMENSION_FIELDS:
      continue
    if name in ("partial_dtype", "owner_sum", "comm_mode"):
      if not isinstance(value, str):
        raise ValueError(f"config field {name}={value!r} must be a string")
      continue
    if name in config_lib.BOOL_FIELDS:
      if not isinstance(value, bool):
        raise ValueError(f"config field {name}={value!r} must be a bool")
      continue
    if not isinstance(value, int) or isinstance(value, bool):
      raise ValueError(f"config field {name}={value!r} must be an int")
  for name in _DIMENSION_FIELDS:
    if name not in kw:
      continue
    dim = kw[name]
    try:
      kw[name] = (config_lib.MatmulDimension[dim] if isinstance(dim, str)
                  else config_lib.MatmulDimension(dim))
    except (KeyError, ValueError):
      raise ValueError(f"{name}={dim!r} must be 'M' or 'N'") from None
  return config_lib.Config(**kw)  # __post_init__ raises ValueError naming the field.


# ---------------------------------------------------------------------------
# Table: validation, I/O, merge.
# ---------------------------------------------------------------------------


def empty_table() -> dict[str, Any]:
  return {"schema_version": SCHEMA_VERSION, "entries": []}


def norm_kind(kind: str) -> str:
  return " ".join(str(kind).split()).lower()


def entry_key(entry: Mapping[str, Any]) -> Key:
  k = entry["key"]
  return Key(k["gpu_kind"], k["num_devices"], k["m"], k["n"], k["k_shard"],
             k["dtype"])


def entry_mode(entry: Mapping[str, Any]) -> str:
  mode = entry.get("mode")
  if mode is None:
    return "single_gpu" if entry["key"]["num_devices"] == 1 else "multi_gpu"
  return mode


def entry_op(entry: Mapping[str, Any]) -> str:
  return entry.get("op", DEFAULT_OP)


def entry_config(entry: Mapping[str, Any]) -> Any:
  """The entry's config object (a `Config`, a `TuningConfig`, or None)."""
  if entry["config"] is None:
    return None
  return _config_codec(entry_op(entry))[1](entry["config"])


def entry_fallback(entry: Mapping[str, Any]) -> Any:
  """The entry's fallback config (None without one): measured faster than XLA in the same run
  as `config`, for where `config` cannot run (e.g. pulling comm CTAs on jax < 0.11.2)."""
  fallback = entry.get("fallback")
  return None if fallback is None else _config_codec(entry_op(entry))[1](fallback["config"])


def is_informational(entry: Mapping[str, Any]) -> bool:
  """Loopback entries: kept in the table, never used to gate."""
  return entry_mode(entry) in INFORMATIONAL_MODES


def identity(entry) -> tuple[str, Key, bool]:
  return entry_op(entry), entry_key(entry).normalized(), is_informational(entry)


def _finite_times(values: Any) -> bool:
  return isinstance(values, list) and all(
      isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
      for v in values)


def _validate_entry(i: int, entry: Any) -> None:
  where = f"entries[{i}]"
  if not isinstance(entry, dict):
    raise ValueError(f"{where} must be an object, got {type(entry).__name__}")
  missing = sorted(_REQUIRED_ENTRY_FIELDS - set(entry))
  if missing:
    raise ValueError(f"{where} is missing fields {missing}")
  unknown = sorted(set(entry) - _ENTRY_FIELDS)
  if unknown:
    raise ValueError(f"{where} has unknown fields {unknown}; known: {sorted(_ENTRY_FIELDS)}")
  key = entry["key"]
  if not isinstance(key, dict):
    raise ValueError(f"{where}.key must be an object, got {type(key).__name__}")
  if set(key) != set(_KEY_FIELDS):
    raise ValueError(f"{where}.key must have exactly the fields {sorted(_KEY_FIELDS)}, "
                     f"got {sorted(key)}")
  for name, typ in _KEY_FIELDS.items():
    value = key[name]
    if not isinstance(value, typ) or isinstance(value, bool):
      raise ValueError(f"{where}.key.{name}={value!r} must be a {typ.__name__}")
    if typ is int and value <= 0:
      raise ValueError(f"{where}.key.{name}={value!r} must be positive")
  if not key["gpu_kind"].strip():
    raise ValueError(f"{where}.key.gpu_kind must not be empty")
  op = entry_op(entry)
  if op not in OPS:
    raise ValueError(f"{where}.op={op!r} must be one of {OPS}")
  impl = entry["implementation"]
  if impl not in CHOICES:
    raise ValueError(f"{where}.implementation={impl!r} must be one of {CHOICES}")
  if entry["config"] is None:
    if impl == "fused" and op == "matmul_rs":
      raise ValueError(f"{where}: implementation='fused' needs a config")
  else:
    try:
      entry_config(entry)
    except ValueError as e:
      raise ValueError(f"{where}.config: {e}") from None
  times = entry["times_us"]
  if not isinstance(times, dict):
    raise ValueError(f"{where}.times_us must be an object of lists")
  for name, values in times.items():
    if not _finite_times(values):
      raise ValueError(f"{where}.times_us.{name} must be a list of finite "
                       f"non-negative numbers")
  fallback = entry.get("fallback")
  if fallback is not None:
    if not isinstance(fallback, dict) or set(fallback) != {"config", "times_us"}:
      raise ValueError(f"{where}.fallback must be an object with fields config and times_us")
    if not _finite_times(fallback["times_us"]) or not fallback["times_us"]:
      raise ValueError(f"{where}.fallback.times_us must be a non-empty list of finite "
                       "non-negative numbers")
    try:
      entry_fallback(entry)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{where}.fallback.config: {e}") from None
  if "env" in entry and not isinstance(entry["env"], dict):
    raise ValueError(f"{where}.env must be an object")
  if "measured_with" in entry and not isinstance(entry["measured_with"], str):
    raise ValueError(f"{where}.measured_with must be a string")
  mode = entry_mode(entry)
  if mode not in MODES:
    raise ValueError(f"{where}.mode={mode!r} must be one of {MODES}")
  d = key["num_devices"]
  if mode == "single_gpu" and d != 1:
    raise ValueError(f"{where}: mode='single_gpu' needs num_devices=1, got {d}")
  if mode == "loopback" and d < 2:
    raise ValueError(f"{where}: mode='loopback' needs num_devices >= 2, got {d}")


def validate_table(table: Any) -> None:
  """Raises ValueError saying what is wrong with `table` (see module doc)."""
  if not isinstance(table, dict):
    raise ValueError(f"tuning table must be a JSON object, got {type(table).__name__}")
  version = table.get("schema_version")
  if version != SCHEMA_VERSION:
    raise ValueError(f"tuning table schema_version={version!r}; this pallas_rs reads "
                     f"schema_version={SCHEMA_VERSION}")
  unknown = sorted(set(table) - {"schema_version", "entries"})
  if unknown:
    raise ValueError(f"tuning table has unknown top-level fields {unknown}")
  entries = table.get("entries")
  if not isinstance(entries, list):
    raise ValueError("tuning table needs an 'entries' list")
  seen: dict[tuple[str, Key, bool], int] = {}
  for i, entry in enumerate(entries):
    _validate_entry(i, entry)
    ident = identity(entry)
    if ident in seen:
      raise ValueError(f"entries[{i}] duplicates entries[{seen[ident]}]: key "
                       f"{tuple(entry_key(entry))} (op {entry_op(entry)!r}, "
                       f"mode {entry_mode(entry)!r})")
    seen[ident] = i


def make_entry(*, op: str = DEFAULT_OP, gpu_kind: str, num_devices: int, m: int, n: int,
               k_shard: int, dtype: str = "bfloat16", fused_us: list[float],
               xla_us: list[float], config_json: dict[str, Any] | None, margin: float = 0.0,
               env: dict[str, Any] | None = None, measured_with: str = "",
               mode: str | None = None,
               fallback: tuple[dict[str, Any], list[float]] | None = None) -> dict[str, Any]:
  """A table entry from raw times: "fused" only if its median beats XLA's by `margin`
  (the autotuner's rule; an empty list means "not measured"). `fallback` (config JSON, its
  times): kept only if it too beats XLA's median by `margin` (`entry_fallback`)."""
  beats_xla = lambda us: (bool(us) and bool(xla_us) and
                          statistics.median(us) < (1.0 - margin) * statistics.median(xla_us))
  fused_wins = beats_xla(fused_us)
  entry = {
      "key": {"gpu_kind": gpu_kind, "num_devices": num_devices, "m": m, "n": n,
              "k_shard": k_shard, "dtype": dtype},
      "implementation": "fused" if fused_wins else "xla",
      "config": config_json,
      "times_us": {"fused": list(fused_us), "xla": list(xla_us)},
      "env": dict(env or {}),
      "measured_with": measured_with,
      "op": op,
  }
  if mode is not None:
    entry["mode"] = mode
  if fallback is not None and beats_xla(fallback[1]):
    entry["fallback"] = {"config": fallback[0], "times_us": list(fallback[1])}
  return entry
