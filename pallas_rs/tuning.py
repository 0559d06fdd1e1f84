"""Per-shape choice of fused vs XLA and of the kernel config, from measurement.

The product promise is "never slower than `jnp.dot` + `lax.psum_scatter`", so
the fused kernel is chosen only where a measurement says it wins. `choose`
consults, in order:

  (a) table: an exact entry for the key
      (gpu_kind, num_devices, m, n, k_shard, dtype) in the tuning table;
  (b) heuristic: for an unmeasured m, the measured entry with the same
      (gpu_kind, num_devices, n, k_shard, dtype) nearest in |log m|; its
      implementation is the gate and its config is re-validated for this shape
      (`Config.check_shape`; if it does not fit, fall through to (c)). A
      roofline estimate (`metrics.estimate_t_gemm` / `estimate_t_comm`) goes
      into the reason only, to explain; it never opens the gate;
  (c) default: `config.default_config(...)` for the kernel and "xla" for the
      gate, at any D (including D = 1): no measurement, no fused.

Shapes the kernel cannot take at all are "xla" before any lookup: a dtype
other than bfloat16, m // D < 64, m // D not a multiple of 64, n not a
multiple of 64, k_shard not a multiple of 64, or D outside 1..8. There is no
padding: such shapes run XLA's composition (TODO(pallas_rs): pad m and n to the
tile instead, once padding is measured not to lose).

The key's `m` is the per-device x's row count (the global token count M; each
device computes an [m, k_shard] @ [k_shard, n] GEMM), as `matmul_reduce_scatter`
sees `x.shape[0]` inside shard_map. `gpu_kind` is `jax.Device.device_kind`
(e.g. "NVIDIA H200"), compared case-insensitively.

The table (JSON, `schema_version` 1):

  {"schema_version": 1,
   "entries": [{"key": {"gpu_kind": str, "num_devices": int, "m": int, "n": int,
                        "k_shard": int, "dtype": str},
                "implementation": "fused" | "xla",
                "config": {Config fields} | null,   # required for "fused"
                "times_us": {"fused": [raw us...], "xla": [raw us...]},
                "env": {...}, "measured_with": str,
                "mode": "single_gpu" | "multi_gpu" | "loopback"}]}  # optional

"mode" defaults to "single_gpu" for num_devices = 1 and "multi_gpu" otherwise.
"loopback" entries (D virtual ranks on one GPU) are informational: they are
kept in the table but never gate a real multi-GPU call. Config fields missing
from an entry take the `Config` defaults; unknown fields are errors.

Which table: `choose(table=...)` if given, else the innermost `use_table(...)`
context, else the file named by the environment variable
PALLAS_RS_TUNING_TABLE (read at every `choose`), else the table shipped in the
package (`pallas_rs/data/tuning_table.json`). A user table replaces the shipped
one; to extend it, `merge_entries(packaged_table(), load_table(path))`.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

from absl import logging
import jax.numpy as jnp
import numpy as np

from pallas_rs import config as config_lib
from pallas_rs import metrics

Config = config_lib.Config

SCHEMA_VERSION = 1
ENV_VAR = "PALLAS_RS_TUNING_TABLE"
PACKAGED_TABLE_PATH = Path(__file__).parent / "data" / "tuning_table.json"
IMPLEMENTATIONS = ("fused", "xla")
SOURCES = ("table", "heuristic", "default", "override")
MODES = ("single_gpu", "multi_gpu", "loopback")
INFORMATIONAL_MODES = ("loopback",)

_KEY_FIELDS = {"gpu_kind": str, "num_devices": int, "m": int, "n": int,
               "k_shard": int, "dtype": str}
_ENTRY_FIELDS = {"key", "implementation", "config", "times_us", "env",
                 "measured_with", "mode"}
_REQUIRED_ENTRY_FIELDS = {"key", "implementation", "config", "times_us"}
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Config))

# The scoped table of `use_table`; None means "not inside use_table".
_scoped_table: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "pallas_rs_tuning_table", default=None)


class Key(NamedTuple):
  """Lookup key of a tuning-table entry."""
  gpu_kind: str
  num_devices: int
  m: int
  n: int
  k_shard: int
  dtype: str

  def normalized(self) -> Key:
    return self._replace(gpu_kind=_norm_kind(self.gpu_kind))


@dataclasses.dataclass(frozen=True)
class Decision:
  """What `choose` picked, and why.

  Attributes:
    implementation: "fused" or "xla".
    config: the kernel config for this shape: the one to run if
      implementation is "fused"; for "xla", the config the fused path would use
      if forced (None where the kernel cannot take the shape).
    source: "table" (exact entry), "heuristic" (nearest measured m),
      "default" (no usable measurement, or a shape the kernel cannot take) or
      "override" (an explicit config from the caller).
    reason: one line for logs, naming the key and the evidence.
  """
  implementation: str
  config: Config | None
  source: str
  reason: str

  def __post_init__(self):
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation={self.implementation!r} must be one of "
                       f"{IMPLEMENTATIONS}")
    if self.source not in SOURCES:
      raise ValueError(f"source={self.source!r} must be one of {SOURCES}")
    if self.implementation == "fused" and self.config is None:
      raise ValueError("a 'fused' decision needs a config")


# ---------------------------------------------------------------------------
# Config <-> JSON.
# ---------------------------------------------------------------------------


def config_to_json(cfg: Config) -> dict[str, Any]:
  """All Config fields; grid_minor_dim by name ("M" or "N")."""
  out = dataclasses.asdict(cfg)
  out["grid_minor_dim"] = cfg.grid_minor_dim.name
  return out


def config_from_json(obj: Mapping[str, Any]) -> Config:
  """Inverse of `config_to_json`; ValueError on unknown fields or bad values."""
  if not isinstance(obj, Mapping):
    raise ValueError(f"config must be an object, got {type(obj).__name__}")
  unknown = sorted(set(obj) - set(_CONFIG_FIELDS))
  if unknown:
    raise ValueError(f"unknown config fields {unknown}; known: {list(_CONFIG_FIELDS)}")
  kw = dict(obj)
  for name, value in kw.items():
    if name == "grid_minor_dim":
      continue
    if name == "partial_dtype":
      if not isinstance(value, str):
        raise ValueError(f"config field {name}={value!r} must be a string")
      continue
    if not isinstance(value, int) or isinstance(value, bool):
      raise ValueError(f"config field {name}={value!r} must be an int")
  if "grid_minor_dim" in kw:
    dim = kw["grid_minor_dim"]
    try:
      kw["grid_minor_dim"] = (config_lib.MatmulDimension[dim] if isinstance(dim, str)
                              else config_lib.MatmulDimension(dim))
    except (KeyError, ValueError):
      raise ValueError(f"grid_minor_dim={dim!r} must be 'M' or 'N'") from None
  return Config(**kw)  # __post_init__ raises ValueError naming the field.


# ---------------------------------------------------------------------------
# Table: validation, I/O, merge.
# ---------------------------------------------------------------------------


def empty_table() -> dict[str, Any]:
  return {"schema_version": SCHEMA_VERSION, "entries": []}


def _norm_kind(kind: str) -> str:
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


def is_informational(entry: Mapping[str, Any]) -> bool:
  """Loopback entries: kept in the table, never used to gate."""
  return entry_mode(entry) in INFORMATIONAL_MODES


def _identity(entry) -> tuple[Key, bool]:
  return entry_key(entry).normalized(), is_informational(entry)


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
  impl = entry["implementation"]
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"{where}.implementation={impl!r} must be one of {IMPLEMENTATIONS}")
  if entry["config"] is None:
    if impl == "fused":
      raise ValueError(f"{where}: implementation='fused' needs a config")
  else:
    try:
      config_from_json(entry["config"])
    except ValueError as e:
      raise ValueError(f"{where}.config: {e}") from None
  times = entry["times_us"]
  if not isinstance(times, dict):
    raise ValueError(f"{where}.times_us must be an object of lists")
  for name, values in times.items():
    if (not isinstance(values, list)
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) and v >= 0 for v in values)):
      raise ValueError(f"{where}.times_us.{name} must be a list of finite "
                       f"non-negative numbers")
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
  seen: dict[tuple[Key, bool], int] = {}
  for i, entry in enumerate(entries):
    _validate_entry(i, entry)
    ident = _identity(entry)
    if ident in seen:
      raise ValueError(f"entries[{i}] duplicates entries[{seen[ident]}]: key "
                       f"{tuple(entry_key(entry))} (mode {entry_mode(entry)!r})")
    seen[ident] = i


def load_table(path: str | os.PathLike) -> dict[str, Any]:
  """Reads and validates a tuning table; ValueError names the file."""
  path = Path(path)
  try:
    table = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON: {e}") from None
  try:
    validate_table(table)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  return table


def save_table(path: str | os.PathLike, table: Mapping[str, Any]) -> None:
  """Validates and writes `table` (sorted entries, atomically via a temp file)."""
  table = dict(table)
  validate_table(table)
  table["entries"] = sorted(table["entries"], key=lambda e: (
      _norm_kind(e["key"]["gpu_kind"]), is_informational(e), *entry_key(e)[1:]))
  path = Path(path)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
  tmp.replace(path)


def merge_entries(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
  """`old` with `new`'s entries added; an entry of `new` replaces the one of
  `old` with the same key (and the same informational/gating kind). Both
  tables are validated; neither is modified."""
  validate_table(old)
  validate_table(new)
  replaced = {_identity(e) for e in new["entries"]}
  entries = [e for e in old["entries"] if _identity(e) not in replaced]
  entries += list(new["entries"])
  out = {"schema_version": SCHEMA_VERSION, "entries": entries}
  validate_table(out)
  return out


@functools.lru_cache(maxsize=1)
def _packaged_table_cached() -> str:
  return json.dumps(load_table(PACKAGED_TABLE_PATH))


def packaged_table() -> dict[str, Any]:
  """The table shipped in the package (a fresh copy)."""
  return json.loads(_packaged_table_cached())


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int, size: int) -> str:
  del mtime_ns, size  # cache key only: a rewritten file is read again.
  return json.dumps(load_table(path))


def _load_path(path) -> dict[str, Any]:
  path = Path(path)
  try:
    st = path.stat()
  except OSError as e:
    raise ValueError(f"tuning table {str(path)!r} cannot be read: {e}") from None
  return json.loads(_load_cached(str(path), st.st_mtime_ns, st.st_size))


@contextlib.contextmanager
def use_table(path_or_table: str | os.PathLike | Mapping[str, Any]) -> Iterator[dict]:
  """Within the block, `choose` (and "auto") consult this table instead.

  Scoped (a context variable): nothing changes outside the block, and nested
  blocks restore the outer table on exit. Yields the validated table.
  """
  if isinstance(path_or_table, Mapping):
    table = dict(path_or_table)
    validate_table(table)
  else:
    table = load_table(path_or_table)
  token = _scoped_table.set(table)
  try:
    yield table
  finally:
    _scoped_table.reset(token)


def active_table(table: Mapping[str, Any] | None = None) -> tuple[dict, str]:
  """(table, where it came from): argument > use_table > env var > packaged."""
  if table is not None:
    table = dict(table)
    validate_table(table)
    return table, "argument"
  scoped = _scoped_table.get()
  if scoped is not None:
    return scoped, "use_table"
  env_path = os.environ.get(ENV_VAR)
  if env_path:
    return _load_path(env_path), f"{ENV_VAR}={env_path}"
  return packaged_table(), "packaged"


# ---------------------------------------------------------------------------
# Choice.
# ---------------------------------------------------------------------------


def unsupported_reason(*, m: int, n: int, k_shard: int, dtype: str,
                       num_devices: int) -> str | None:
  """Why the kernel cannot take this shape at all (no padding), or None: the kernel's own
  rule, `fused.check_supported` with its default config."""
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top  (fused is heavier to import)
  try:
    fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=dtype, num_devices=num_devices)
  except (NotImplementedError, ValueError, TypeError) as e:
    return str(e)
  return None


def _median(values) -> float | None:
  return float(np.median(values)) if values else None


def _evidence(entry) -> str:
  times = entry.get("times_us", {})
  f, x = _median(times.get("fused")), _median(times.get("xla"))
  parts = []
  if f is not None:
    parts.append(f"fused median {f:.1f} us")
  if x is not None:
    parts.append(f"xla median {x:.1f} us")
  return ", ".join(parts) or "no times recorded"


def _fits(cfg: Config | None, key: Key) -> str | None:
  """None if `cfg` can run the shape of `key`, else why not."""
  if cfg is None:
    return "no config"
  try:
    cfg.check_shape(m=key.m, n=key.n, k_shard=key.k_shard, num_devices=key.num_devices)
  except NotImplementedError as e:
    return str(e)
  return None


def _roofline_note(key: Key) -> str:
  t_gemm = metrics.estimate_t_gemm(key.m, key.k_shard, key.n) * 1e6
  t_comm = metrics.estimate_t_comm(key.m, key.n, key.num_devices) * 1e6
  return (f"roofline estimate (explanation only, not the gate): "
          f"T_gemm~{t_gemm:.1f} us, T_comm~{t_comm:.1f} us")


def _default_config(key: Key) -> Config | None:
  try:
    return config_lib.default_config(m=key.m, n=key.n, k_shard=key.k_shard,
                                     num_devices=key.num_devices)
  except NotImplementedError:
    return None


def choose(*, m: int, n: int, k_shard: int, dtype, num_devices: int, gpu_kind: str,
           table: Mapping[str, Any] | None = None,
           config: Config | None = None) -> Decision:
  """Chooses fused vs XLA and the kernel config for one per-device problem.

  Args:
    m: rows of the per-device x [m, k_shard] (global tokens); output [m // D, n].
    n: output columns.
    k_shard: per-device contraction size K / D.
    dtype: input dtype (name or numpy/jax dtype).
    num_devices: D.
    gpu_kind: `jax.Device.device_kind`, e.g. "NVIDIA H200".
    table: a table to consult instead of the active one (see module doc).
    config: an explicit kernel config from the caller: "fused" with it if it
      fits the shape (source "override"; the caller asked for that config),
      else "xla" saying why.

  Returns:
    A `Decision`. Never "fused" without a measurement (table or nearest
    measured m) or an explicit config.

  Raises:
    ValueError: an invalid table (schema errors name the entry).
  """
  try:
    dtype = jnp.dtype(dtype).name
  except TypeError:
    dtype = str(dtype)  # unknown: reported as unsupported below
  key = Key(str(gpu_kind), int(num_devices), int(m), int(n), int(k_shard), dtype)
  why_not = unsupported_reason(m=m, n=n, k_shard=k_shard, dtype=dtype,
                               num_devices=num_devices)
  if why_not is not None:
    return Decision("xla", None, "default", why_not)
  if config is not None:
    bad = _fits(config, key)
    if bad is None:
      return Decision("fused", config, "override", f"explicit config for {tuple(key)}")
    return Decision("xla", None, "override",
                    f"explicit config does not fit {tuple(key)}: {bad}")

  tbl, where = active_table(table)
  nkey = key.normalized()
  gating = [e for e in tbl["entries"] if not is_informational(e)]
  notes = []
  # (a) exact entry.
  for entry in gating:
    if entry_key(entry).normalized() != nkey:
      continue
    cfg = config_from_json(entry["config"]) if entry["config"] is not None else None
    if entry["implementation"] == "xla":
      return Decision("xla", cfg if _fits(cfg, key) is None else _default_config(key),
                      "table", f"measured {tuple(key)} ({where}): {_evidence(entry)}")
    bad = _fits(cfg, key)
    if bad is None:
      return Decision("fused", cfg, "table",
                      f"measured {tuple(key)} ({where}): {_evidence(entry)}")
    notes.append(f"table config for this key does not fit: {bad}")
    break
  # (b) nearest measured m with the same (gpu_kind, D, n, k_shard, dtype).
  near = [e for e in gating
          if entry_key(e).normalized()._replace(m=key.m) == nkey and e["key"]["m"] != m]
  if near:
    entry = min(near, key=lambda e: (abs(math.log(e["key"]["m"] / m)), e["key"]["m"]))
    ek = entry_key(entry)
    base = (f"nearest measured shape m={ek.m} for {tuple(key)} ({where}): "
            f"{entry['implementation']} ({_evidence(entry)}); {_roofline_note(key)}")
    logging.debug("pallas_rs.tuning: %s", base)
    if entry["implementation"] == "xla":
      return Decision("xla", _default_config(key), "heuristic", base)
    cfg = config_from_json(entry["config"])
    bad = _fits(cfg, key)
    if bad is None:
      return Decision("fused", cfg, "heuristic", base)
    notes.append(f"nearest measured config (m={ek.m}) does not fit: {bad}")
  # (c) defaults: the kernel's default config, XLA as the gate.
  cfg = _default_config(key)
  reason = (f"no measurement for {tuple(key)} ({where} table); XLA until a measurement "
            f"shows the fused kernel wins")
  if notes:
    reason += "; " + "; ".join(notes)
  return Decision("xla", cfg, "default", reason)


# ---------------------------------------------------------------------------
# Candidate configs for the tuner, likeliest winners first.
# ---------------------------------------------------------------------------

# Fields varied one at a time around the default, in this priority order; each
# value list is ordered nearest-first.
_VARIANT_FIELDS = ("comm_ctas", "tile_m", "tile_n", "grid_minor_dim", "grid_tile_width",
                   "max_concurrent_steps", "recv_stages", "eager_signal_steps")
# Fields that change nothing at D = 1 (no receive buffers, no signals).
_MULTI_DEVICE_FIELDS = ("comm_ctas", "recv_stages", "eager_signal_steps")


def candidate_configs(*, m: int, n: int, k_shard: int, num_devices: int,
                      max_configs: int | None = None,
                      num_sms: int = config_lib.DEFAULT_NUM_SMS) -> list[Config]:
  """`default_config` first, then `config.search_space` ordered for diversity.

  Deterministic. After the default come configs differing from it in one field
  (tile_m, then tile_n, grid_minor_dim, grid_tile_width, max_concurrent_steps,
  recv_stages, eager_signal_steps: one variant of each field before a second of any), then two
  fields, and so on; so the first few cover every axis once. Every config is
  valid for the shape and within the SMEM limit. Empty if the kernel cannot
  take the shape.
  """
  try:
    default = config_lib.default_config(m=m, n=n, k_shard=k_shard,
                                        num_devices=num_devices, num_sms=num_sms)
  except NotImplementedError:
    return []
  space = list(config_lib.search_space(m=m, n=n, k_shard=k_shard,
                                       num_devices=num_devices, num_sms=num_sms))
  fields = [f for f in _VARIANT_FIELDS
            if not (f in _MULTI_DEVICE_FIELDS and num_devices == 1)]
  if num_devices == 1:
    # recv_stages allocates nothing at D = 1: configs differing only in it are
    # the same kernel, so take the default's value.
    space = [dataclasses.replace(c, recv_stages=default.recv_stages) for c in space]

  def diff(cfg):
    return [f for f in fields if getattr(cfg, f) != getattr(default, f)]

  def distance(cfg, f):
    a, b = int(getattr(cfg, f)), int(getattr(default, f))
    return abs(math.log2(a / b)) if a > 0 and b > 0 else 1.0

  # rank[f][value]: 0 for the default's value, then nearest values first.
  rank = {}
  for f in fields:
    values = sorted({int(getattr(c, f)) for c in space} | {int(getattr(default, f))},
                    key=lambda v, f=f: (v != int(getattr(default, f)),
                                        distance(dataclasses.replace(default, **{f: v}), f)
                                        if f != "grid_minor_dim" else 0, v))
    rank[f] = {v: i for i, v in enumerate(values)}

  def sort_key(cfg):
    d = diff(cfg)
    # Fewer changed fields first; among those, nearer values (so one variant of
    # every field comes before a second variant of any), then field priority.
    return (len(d), sum(rank[f][int(getattr(cfg, f))] for f in d),
            tuple(fields.index(f) for f in d),
            tuple(int(getattr(cfg, f)) for f in fields))

  ordered = [default]
  seen = {default}
  for cfg in sorted(space, key=sort_key):
    if cfg not in seen:
      seen.add(cfg)
      ordered.append(cfg)
  if max_configs is not None and max_configs > 0:
    ordered = ordered[:max_configs]
  return ordered


def adapt_config(cfg: Config, *, m: int, n: int, k_shard: int,
                 num_devices: int) -> Config | None:
  """`cfg` made to fit another D: recv_stages for D > 1, tile_m for the chunk,
  fewer pipeline stages for SMEM. None if it still does not fit."""
  cand = cfg
  if num_devices > 1 and cand.recv_stages < 2:
    cand = dataclasses.replace(cand, recv_stages=2)
  if (m // num_devices) % cand.tile_m:
    cand = dataclasses.replace(cand, tile_m=64)
  while not cand.fits_smem(num_devices) and cand.max_concurrent_steps > 2:
    cand = dataclasses.replace(cand, max_concurrent_steps=cand.max_concurrent_steps - 1)
  try:
    cand.check_shape(m=m, n=n, k_shard=k_shard, num_devices=num_devices)
  except NotImplementedError:
    return None
  return cand
