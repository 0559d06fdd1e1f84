"""The tuning table: schema, I/O, merge, and the measured entry for a shape.

The fused kernels are chosen only where a measurement says they win ("never slower than
`jnp.dot` + `lax.psum_scatter`", docs/design.md section 6). This module holds the
measurements; `pallas_rs.tuning.gate` makes the decision from them, and `pallas_rs.tuning.candidates`
proposes the configs the tuner (experiments/autotune.py) measures. `select` consults, in order:

  (a) table: an exact entry for (op, gpu_kind, num_devices, m, n, k_shard, dtype); where its
      config cannot run here (pulling comm CTAs on jax < 0.11.2), the entry's "fallback"
      config, measured faster than XLA in the same run, if it has one, else "xla" (that
      run timed the push configs beside it: none beat XLA); another unfit config falls
      through to (b);
  (b) heuristic: for an unmeasured m, the measured entry with the same
      (op, gpu_kind, num_devices, n, k_shard, dtype) nearest in |log m|; its
      implementation is the gate and its config is re-validated for this shape
      (if it does not fit, fall through to (c)). A roofline estimate
      (`metrics.estimate_t_gemm` / `estimate_t_comm`) goes into the reason only, to
      explain; it never opens the gate;
  (c) default: the kernel's default config and "xla" for the gate, at any D
      (including D = 1): no measurement, no fused.

Two ops share the table ("op", default "matmul_rs" so that older files load unchanged):

  "matmul_rs"  this package's matmul + reduce-scatter. `m` is the per-device x's row
               count (the global token count M; each device computes an
               [m, k_shard] @ [k_shard, n] GEMM), as `matmul_reduce_scatter` sees
               `x.shape[0]` inside shard_map. config: `Config` fields, required for "fused".
  "ag_matmul"  jax's all-gather matmul (`pallas_rs.kernel.ag_matmul`). `m` is the gathered row
               count (m_shard * D), `k_shard` the contraction size each device multiplies
               (lhs.shape[1]: not sharded in this op), `n` this device's output columns.
               config: `hopper_matmul_mgpu.TuningConfig` fields, or null for the kernel's
               default.

`gpu_kind` is `jax.Device.device_kind` (e.g. "NVIDIA H200"), compared case-insensitively.
The table (JSON, `schema_version` 1):

  {"schema_version": 1,
   "entries": [{"key": {"gpu_kind": str, "num_devices": int, "m": int, "n": int,
                        "k_shard": int, "dtype": str},
                "op": "matmul_rs" | "ag_matmul",                     # optional
                "implementation": "fused" | "xla",
                "config": {config fields} | null,
                "times_us": {"fused": [raw us...], "xla": [raw us...]},
                "env": {...}, "measured_with": str,
                "mode": "single_gpu" | "multi_gpu" | "loopback",   # optional
                "fallback": {"config": {...}, "times_us": [raw us...]}}]}  # optional

"mode" defaults to "single_gpu" for num_devices = 1 and "multi_gpu" otherwise.
"loopback" entries (D virtual ranks on one GPU) are informational: they are
kept in the table but never gate a real multi-GPU call. Config fields missing
from an entry take the defaults; unknown fields are errors.

Which table: `select(table=...)` if given, else the innermost `use_table(...)`
context, else the file named by the environment variable
PALLAS_RS_TUNING_TABLE (read at every lookup), else the table shipped in the
package (`pallas_rs/tuning/data/tuning_table.json`). A user table replaces the shipped
one; to extend it, `merge_entries(packaged_table(), load_table(path))`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from absl import logging
import jax.numpy as jnp
import numpy as np

from pallas_rs.tuning import metrics
# The schema's names are part of this module's interface (tests, experiments/autotune.py).
from pallas_rs.tuning.schema import CHOICES  # pylint: disable=unused-import
from pallas_rs.tuning.schema import config_from_json  # pylint: disable=unused-import
from pallas_rs.tuning.schema import config_to_json  # pylint: disable=unused-import
from pallas_rs.tuning.schema import DEFAULT_OP
from pallas_rs.tuning.schema import Decision
from pallas_rs.tuning.schema import empty_table  # pylint: disable=unused-import
from pallas_rs.tuning.schema import entry_config
from pallas_rs.tuning.schema import entry_fallback
from pallas_rs.tuning.schema import entry_key
from pallas_rs.tuning.schema import entry_mode  # pylint: disable=unused-import
from pallas_rs.tuning.schema import entry_op
from pallas_rs.tuning.schema import identity
from pallas_rs.tuning.schema import is_informational
from pallas_rs.tuning.schema import Key
from pallas_rs.tuning.schema import norm_kind
from pallas_rs.tuning.schema import OPS  # pylint: disable=unused-import
from pallas_rs.tuning.schema import SCHEMA_VERSION
from pallas_rs.tuning.schema import SOURCES  # pylint: disable=unused-import
from pallas_rs.tuning.schema import validate_table

ENV_VAR = "PALLAS_RS_TUNING_TABLE"
PACKAGED_TABLE_PATH = Path(__file__).parent / "data" / "tuning_table.json"

# The scoped table of `use_table`; None means "not inside use_table".
_scoped_table: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "pallas_rs_tuning_table", default=None)


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
      entry_op(e) != DEFAULT_OP, entry_op(e), norm_kind(e["key"]["gpu_kind"]),
      is_informational(e), *entry_key(e)[1:]))
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
  replaced = {identity(e) for e in new["entries"]}
  entries = [e for e in old["entries"] if identity(e) not in replaced]
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
  """Within the block, `select` (and so "auto") consult this table instead.

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
# Selection: the measured entry for a shape.
# ---------------------------------------------------------------------------


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


def _roofline_note(key: Key) -> str:
  t_gemm = metrics.estimate_t_gemm(key.m, key.k_shard, key.n) * 1e6
  t_comm = metrics.estimate_t_comm(key.m, key.n, key.num_devices) * 1e6
  return (f"roofline estimate (explanation only, not the gate): "
          f"T_gemm~{t_gemm:.1f} us, T_comm~{t_comm:.1f} us")


def make_key(*, m: int, n: int, k_shard: int, dtype, num_devices: int, gpu_kind: str) -> Key:
  """The lookup key, with `dtype` by name."""
  try:
    dtype = jnp.dtype(dtype).name
  except TypeError:
    dtype = str(dtype)  # unknown: the caller reports it as unsupported
  return Key(str(gpu_kind), int(num_devices), int(m), int(n), int(k_shard), dtype)


def _gating(table: Mapping[str, Any], op: str) -> list[dict]:
  """The table's entries that decide for `op` (measurements, not informational records)."""
  return [e for e in table["entries"] if not is_informational(e) and entry_op(e) == op]


def _exact(entries, key: Key) -> dict | None:
  nkey = key.normalized()
  return next((e for e in entries if entry_key(e).normalized() == nkey), None)


def exact_entry(key: Key, *, op: str = DEFAULT_OP,
                table: Mapping[str, Any] | None = None) -> dict | None:
  """The active (or given) table's measured entry for exactly `key` (`make_key`), or None:
  the one `select` decides by first."""
  return _exact(_gating(active_table(table)[0], op), key)


def select(key: Key, *, default: Any, fits: Callable[[Any], str | None],
           op: str = DEFAULT_OP, table: Mapping[str, Any] | None = None) -> Decision:
  """The table's decision for a shape the kernel supports (module doc: (a), (b), (c)).

  Args:
    key: the shape (`make_key`).
    default: the kernel's default config for it (used by "xla" decisions, by (c), and by
      "ag_matmul" entries without a config).
    fits: `fits(config)` is None if the kernel can run `key` with `config`, else why not.
    op: "matmul_rs" or "ag_matmul".
    table: a table to consult instead of the active one.

  Returns:
    A `Decision` with source "table", "heuristic" or "default". Never "fused" without a
    measurement.

  Raises:
    ValueError: an invalid table (schema errors name the entry).
  """
  tbl, where = active_table(table)
  nkey = key.normalized()
  gating = _gating(tbl, op)

  def config_of(entry):
    cfg = entry_config(entry)
    return default if cfg is None else cfg

  def fit_or(cfg, fallback):
    return cfg if cfg is not None and fits(cfg) is None else fallback

  notes = []
  # (a) exact entry.
  entry = _exact(gating, key)
  if entry is not None:
    cfg = config_of(entry)
    why = f"measured {tuple(key)} ({where}): {_evidence(entry)}"
    if entry["implementation"] == "xla":
      return Decision("xla", fit_or(cfg, default), "table", why)
    bad = fits(cfg) if cfg is not None else "no config"
    if bad is None:
      return Decision("fused", cfg, "table", why)
    fallback = entry_fallback(entry)
    if fallback is not None and fits(fallback) is None:
      return Decision("fused", fallback, "table",
                      f"{why}; its config cannot run here ({bad}): the entry's fallback, "
                      f"median {np.median(entry['fallback']['times_us']):.1f} us")
    if fallback is None and getattr(cfg, "reads_peers", False):
      # The tuner times a pulling entry's push fallback beside it and keeps it only if it beat
      # XLA: this very shape's run found nothing that runs here beating XLA, so another m's
      # config would be a guess against the measurement.
      return Decision("xla", default, "table",
                      f"{why}; its config cannot run here ({bad}) and no config without "
                      "remote loads beat XLA in the same run")
    notes.append(f"table config for this key does not fit: {bad}")
  # (b) nearest measured m with the same (op, gpu_kind, D, n, k_shard, dtype).
  near = [e for e in gating
          if entry_key(e).normalized()._replace(m=key.m) == nkey and e["key"]["m"] != key.m]
  if near:
    entry = min(near, key=lambda e: (abs(math.log(e["key"]["m"] / key.m)), e["key"]["m"]))
    base = (f"nearest measured shape m={entry['key']['m']} for {tuple(key)} ({where}): "
            f"{entry['implementation']} ({_evidence(entry)}); {_roofline_note(key)}")
    logging.debug("pallas_rs.tuning: %s", base)
    if entry["implementation"] == "xla":
      return Decision("xla", default, "heuristic", base)
    cfg = config_of(entry)
    bad = fits(cfg) if cfg is not None else "no config"
    if bad is None:
      return Decision("fused", cfg, "heuristic", base)
    notes.append(f"nearest measured config (m={entry['key']['m']}) does not fit: {bad}")
  # (c) defaults: the kernel's default config, XLA as the gate.
  reason = (f"no measurement for {tuple(key)} ({where} table); XLA until a measurement "
            f"shows the fused kernel wins")
  if notes:
    reason += "; " + "; ".join(notes)
  return Decision("xla", default, "default", reason)
