"""The harness's results schema, shared by matmul_rs_bench.py, plot_results.py and the tests.

One record per (shape, implementation, mode); `validate_record` is the schema. No flags and no
jax at module level (the main sets XLA_FLAGS before jax is first imported).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_env import default_out
from bench_env import fmt
from bench_env import utc_stamp

SCHEMA_VERSION = 1
RESOLVED_MODES = ("smoke", "single_gpu", "multi_gpu")
TIMERS = ("auto", "cupti", "host_wall_clock")
AXIS = "tp"
BASELINES = ("gemm", "comm", "seq")
PEER = "xla_windowed_einsum"
LOCAL = ("local_xla", "local_fused")
LOOPBACK = ("loopback_gemm", "loopback_reference", "loopback_fused")
WINDOWED_EINSUM_OPTION = "xla_gpu_threshold_for_windowed_einsum_mib"

# ---------------------------------------------------------------------------
# Records.
# ---------------------------------------------------------------------------


def all_implementations() -> tuple[str, ...]:
  """Every record's possible implementation: the baselines, the op's own
  (`pallas_rs.api.IMPLEMENTATIONS`), the XLA peer, single_gpu's LOCAL and LOOPBACK."""
  from pallas_rs.api import IMPLEMENTATIONS  # pylint: disable=g-import-not-at-top  (jax)
  return BASELINES + IMPLEMENTATIONS + (PEER,) + LOCAL + LOOPBACK


def shape_block(case, num_devices: int | None = None) -> dict[str, Any]:
  d = case.num_devices if num_devices is None else num_devices
  return {"name": case.name, "m": case.m, "n": case.n, "k": case.k,
          "num_devices": d, "k_shard": case.k // d, "m_shard": case.m // d,
          "dtype": case.dtype}


_REQUIRED = {"mode": str, "shape": dict, "implementation": str, "status": str,
             "timer": (str, type(None)), "performance_claims": bool,
             "timing": (dict, type(None)), "check": (dict, type(None)),
             "throughput": (dict, type(None)), "metrics": (dict, type(None)),
             "estimates": (dict, type(None)), "notes": list}


def validate_record(record: dict[str, Any]) -> None:
  """Raises ValueError if `record` does not follow the results schema.

  Schema (one record per (shape, implementation, mode)):
    mode: "smoke" | "single_gpu" | "multi_gpu".
    shape: {name, m, n, k, num_devices, k_shard, m_shard, dtype}.
    implementation: one of all_implementations().
    status: "ok" | "unavailable: <reason>" | "failed: <reason>".
    timer: "cupti" | "host_wall_clock" (None unless ok).
    performance_claims: False for the host wall clock.
    timing: None unless ok; else timing.Timing.to_json(): times_us (raw, one
      per iteration), times_min_us, stats {count, median, min, max, mean, std,
      p90, p95}, rule, iterations, warmup, compile_s, host_batch_us, kernels,
      notes, device_times_us and device_medians_us (records paired with devices,
      pallas_rs.bench.cupti; else None).
    check: None (--nocheck, or not ok) or {max_rel_error, reference,
      unfused_max_rel_error, ratio_to_unfused, rule, rule_applied, passed}; a judged
      record whose rule could not be applied (no unfused error) has rule_applied false and
      passed false.
    throughput: {tflops, gbps} from the median (None unless ok).
    metrics: overlap figures (overlap implementations) or D = 1 / loopback
      ratios; None when a needed time is missing.
    estimates: metrics.roofline_estimates (labelled estimates) or None.
    notes: list of strings.
    clocks (GPU modes, optional): the SM clock, power and clock-lowering reasons sampled
      while the record's shape ran (gpu_clocks.ClockLog.summary, per GPU), or why none.
  """
  if not isinstance(record, dict):
    raise ValueError(f"record must be a dict, got {type(record).__name__}")
  for key, types in _REQUIRED.items():
    if key not in record:
      raise ValueError(f"record lacks {key=}")
    if not isinstance(record[key], types):
      raise ValueError(f"record[{key!r}]={record[key]!r} has the wrong type")
  if record["mode"] not in RESOLVED_MODES:
    raise ValueError(f"record['mode']={record['mode']!r} not in {RESOLVED_MODES}")
  if record["implementation"] not in all_implementations():
    raise ValueError(f"record['implementation']={record['implementation']!r} "
                     f"not in {all_implementations()}")
  shape = record["shape"]
  for key in ("m", "n", "k", "num_devices", "k_shard", "m_shard"):
    if not isinstance(shape.get(key), int) or shape[key] <= 0:
      raise ValueError(f"shape[{key!r}]={shape.get(key)!r} must be a positive int")
  for key in ("name", "dtype"):
    if not isinstance(shape.get(key), str):
      raise ValueError(f"shape[{key!r}]={shape.get(key)!r} must be a str")
  status = record["status"]
  if status == "ok":
    if record["timer"] not in ("cupti", "host_wall_clock"):
      raise ValueError(f"record['timer']={record['timer']!r} for status ok")
    if record["timer"] == "host_wall_clock" and record["performance_claims"]:
      raise ValueError("host_wall_clock records make no performance claims")
    timing = record["timing"]
    if timing is None:
      raise ValueError("status ok needs a timing block")
    times = timing.get("times_us")
    if (not isinstance(times, list) or len(times) != timing.get("iterations")
        or not times):
      raise ValueError(f"timing.times_us must hold iterations="
                       f"{timing.get('iterations')!r} raw times")
    if not all(isinstance(t, (int, float)) and t >= 0 for t in times):
      raise ValueError("timing.times_us must be non-negative numbers")
    stats = timing.get("stats") or {}
    for key in ("median", "min", "p90", "p95", "count"):
      if key not in stats:
        raise ValueError(f"timing.stats lacks {key=}")
    check = record["check"]
    if check is not None:
      err = check.get("max_rel_error")
      if not isinstance(check.get("passed"), bool):
        raise ValueError(f"check.passed={check.get('passed')!r} must be a bool")
      # null: a NaN error (the JSON has no NaN), which never passes.
      if err is None and check["passed"]:
        raise ValueError("check.max_rel_error=None (a NaN error) cannot pass")
      if err is not None and (not isinstance(err, (int, float)) or err < 0):
        raise ValueError(f"check.max_rel_error={err!r} must be a number >= 0 or null")
  elif status.startswith(("unavailable: ", "failed: ")):
    if record["timing"] is not None:
      raise ValueError(f"{status=} must not carry a timing block")
  else:
    raise ValueError(f"record['status']={status!r} must be 'ok', "
                     "'unavailable: <reason>' or 'failed: <reason>'")


def validate_results(doc: dict[str, Any]) -> None:
  """Validates a whole results file (environment block + records)."""
  for key in ("schema_version", "environment", "flags", "records"):
    if key not in doc:
      raise ValueError(f"results lack {key=}")
  for key in ("jax_version", "jaxlib_version", "backend", "device_count",
              "XLA_FLAGS", "nccl_env", "git_commit", "git_dirty", "command",
              "date_utc", "driver_version"):
    if key not in doc["environment"]:
      raise ValueError(f"environment lacks {key=}")
  for record in doc["records"]:
    validate_record(record)


def default_out_path(mode: str) -> Path:
  """experiments/out/<mode>_<UTC stamp>.json (git-ignored, `bench_env.default_out`): any mode,
  smoke or GPU; curated results go to experiments/results/ only through --out."""
  return default_out(f"{mode}_{utc_stamp()}.json")


LEGEND = """\
Rows per shape: gemm = jnp.dot alone (T_gemm), comm = psum_scatter of the [m, n] product alone
(T_comm), seq = dot then psum_scatter (T_seq, today's unfused path), then each implementation of
the op (fused = the Pallas kernel, xla, auto) and xla_windowed_einsum (XLA's collective matmul).
E = (T_gemm + T_comm - T_fused) / min(T_gemm, T_comm): 0 = no overlap, 1 = the fused time reached
max(T_gemm, T_comm); E 95% = its interval over the timing rounds (a bootstrap of rounds);
over_us = median - max(T_gemm, T_comm), the microseconds above perfect overlap;
speedup = T_seq / T_fused. max_rel_err is normwise against a float64 numpy
reference; ratio = that error / the unfused path's (the seed rule: <= 1.1)."""


def _check_word(chk: dict[str, Any], sep: str = "") -> str:
  """"" for a passed (or absent) check; "UNCHECKED (...)" where the error rule could not be
  applied (no unfused error to compare with); "CHECK FAILED" otherwise."""
  if chk.get("passed", True):
    return ""
  if chk.get("rule_applied") is False:
    return sep + "UNCHECKED (no unfused error)"
  return sep + "CHECK FAILED"


def progress_line(done: int, total: int, records: Sequence[dict[str, Any]],
                  elapsed_s: float) -> str:
  """The line printed as each shape finishes: its records' medians (us) or statuses."""
  names = list(dict.fromkeys(r["shape"]["name"] for r in records))
  ds = {r["shape"]["num_devices"] for r in records}
  parts = []
  for r in records:
    label = r["implementation"] + (f"@D{r['shape']['num_devices']}" if len(ds) > 1 else "")
    if r["status"] == "ok":
      chk = r["check"] or {}
      value = fmt(r["timing"]["stats"]["median"], ".1f") + _check_word(chk, " ")
    else:
      value = r["status"].split(":")[0]
    parts.append(f"{label} {value}")
  where = f" D={ds.pop()}" if len(ds) == 1 else ""
  return (f"[{done}/{total}] {', '.join(names) or '-'}{where} ({elapsed_s:.0f} s): median us "
          + ", ".join(parts))


def _interval(mets: dict[str, Any]) -> str:
  """E's 95% bootstrap interval over the timing rounds as 'lo..hi', or '-'."""
  ci = mets.get("overlap_efficiency_ci95")
  return f"{ci[0]:.2f}..{ci[1]:.2f}" if ci else "-"


def _over_ideal_us(stats: dict[str, Any], mets: dict[str, Any]) -> float | None:
  """The median's microseconds above max(T_gemm, T_comm), or None without both."""
  median, ideal = stats.get("median"), mets.get("t_ideal_us")
  return None if median is None or ideal is None else median - ideal


def format_table(records: Sequence[dict[str, Any]]) -> str:
  """A short fixed-width table: one row per record."""
  header = (f"{'shape':<40} {'impl':<20} {'D':>2} {'median_us':>10} "
            f"{'p90_us':>9} {'E':>6} {'E 95%':>11} {'over_us':>7} {'speedup':>7} "
            f"{'max_rel_err':>11} {'ratio':>6} status")
  lines = [header, "-" * len(header)]
  for r in records:
    stats = (r["timing"] or {}).get("stats") or {}
    # Ratios of host wall-clock times on CPU are noise: not printed as results (the JSON keeps
    # them, labelled performance_claims=false).
    mets = (r["metrics"] or {}) if r["performance_claims"] else {}
    chk = r["check"] or {}
    status = r["status"] if r["status"] != "ok" else (_check_word(chk) or "ok")
    if r["status"] == "ok" and not r["performance_claims"]:
      status += " (no perf claims)"
    lines.append(
        f"{r['shape']['name'][:40]:<40} {r['implementation'][:20]:<20} "
        f"{r['shape']['num_devices']:>2} {fmt(stats.get('median')):>10} "
        f"{fmt(stats.get('p90')):>9} "
        f"{fmt(mets.get('overlap_efficiency')):>6} {_interval(mets):>11} "
        f"{fmt(_over_ideal_us(stats, mets), '.1f'):>7} "
        f"{fmt(mets.get('speedup_vs_seq', mets.get('speedup_vs_reference'))):>7} "
        f"{fmt(chk.get('max_rel_error'), '.3g'):>11} "
        f"{fmt(chk.get('ratio_to_unfused')):>6} {status[:90]}")
  return "\n".join(lines)
