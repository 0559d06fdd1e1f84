"""Flops, bytes, overlap figures and roofline estimates for matmul + reduce-scatter.

Pure functions of numbers (no JAX): the benchmark (`experiments/`) and the
tuner share them, so that a figure means the same thing everywhere.

Notation (per device, row-parallel layer over `num_devices` = D devices):
`x: [m, k_shard]`, `w: [k_shard, n]`, output `[m // D, n]`.

Times are in any unit as long as all arguments of one call share it (the
benchmark uses microseconds); rates take seconds.

Overlap figures (docs/design.md section 2):
  E = (T_gemm + T_comm - T_fused) / min(T_gemm, T_comm)   the headline.
      0: no better than running the two one after the other; 1: the fused
      time reached max(T_gemm, T_comm). Negative when the fused path is slower
      than the sequential sum; that is legal and reported, never clipped.
  comm_hidden = (T_gemm + T_comm - T_fused) / T_comm         the literal
      "fraction of the communication hidden"; reported, not the target.
  speedup = T_seq / T_fused.
  fused_over_ideal = T_fused / max(T_gemm, T_comm)        >= 1 in practice;
      keeps a slow communication path from hiding behind E.

Roofline estimates are ESTIMATES from measured peak rates, not datasheet
numbers; they are labelled as such wherever they are written out.
"""
from __future__ import annotations

from collections.abc import Sequence
import math

import numpy as np

# Measured on one H200/H100 (docs/design.md section 7): dense bf16 GEMM throughput.
# Not the datasheet's 989 TFLOP/s: the figure a real cuBLAS GEMM reaches.
MEASURED_PEAK_FLOPS_BF16 = 790e12
# Measured NCCL ring reduce-scatter bus bandwidth at 128 MB on 8xH100
# (docs/design.md section 7), NCCL's "busbw" convention.
MEASURED_RS_BUS_BANDWIDTH = 311e9
ESTIMATE_LABEL = (
    "roofline estimate from measured peaks (bf16 dense 790e12 FLOP/s, "
    "NCCL reduce-scatter busbw 311e9 B/s; docs/design.md section 7), not a "
    "measurement")


def _check_positive(**values: float) -> None:
  for name, value in values.items():
    if value is None or not isinstance(value, (int, float, np.integer,
                                               np.floating)):
      raise ValueError(f"{name}={value!r} must be a real number")
    if not math.isfinite(value) or value <= 0:
      raise ValueError(f"{name}={value!r} must be finite and > 0")


def _check_dims(**dims: int) -> None:
  for name, value in dims.items():
    if not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError(f"{name}={value!r} must be a positive integer")


# ---------------------------------------------------------------------------
# Overlap figures.
# ---------------------------------------------------------------------------


def overlap_efficiency(t_gemm: float, t_comm: float, t_fused: float) -> float:
  """E = (t_gemm + t_comm - t_fused) / min(t_gemm, t_comm); may be negative."""
  _check_positive(t_gemm=t_gemm, t_comm=t_comm, t_fused=t_fused)
  return (t_gemm + t_comm - t_fused) / min(t_gemm, t_comm)


def comm_hidden_fraction(t_gemm: float, t_comm: float, t_fused: float) -> float:
  """(t_gemm + t_comm - t_fused) / t_comm: the literal "comm hidden" figure."""
  _check_positive(t_gemm=t_gemm, t_comm=t_comm, t_fused=t_fused)
  return (t_gemm + t_comm - t_fused) / t_comm


def speedup(t_seq: float, t_fused: float) -> float:
  """t_seq / t_fused: > 1 means the fused path beats dot-then-reduce-scatter."""
  _check_positive(t_seq=t_seq, t_fused=t_fused)
  return t_seq / t_fused


def fused_over_ideal(t_gemm: float, t_comm: float, t_fused: float) -> float:
  """t_fused / max(t_gemm, t_comm): 1 is perfect overlap."""
  _check_positive(t_gemm=t_gemm, t_comm=t_comm, t_fused=t_fused)
  return t_fused / max(t_gemm, t_comm)


def overlap_metrics(*, t_gemm: float, t_comm: float, t_seq: float,
                    t_fused: float) -> dict[str, float]:
  """All overlap figures of one shape, as a JSON-ready dict (same time unit)."""
  return {
      "overlap_efficiency": overlap_efficiency(t_gemm, t_comm, t_fused),
      "comm_hidden_fraction": comm_hidden_fraction(t_gemm, t_comm, t_fused),
      "speedup_vs_seq": speedup(t_seq, t_fused),
      "fused_over_ideal": fused_over_ideal(t_gemm, t_comm, t_fused),
      "t_ideal": max(t_gemm, t_comm),
      "gemm_over_comm": t_gemm / t_comm,
  }


def overlap_interval(t_gemm: Sequence[float], t_comm: Sequence[float],
                     t_fused: Sequence[float], *, rounds: int, level: float = 0.95,
                     draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
  """A `level` percentile interval of E (of the three functions' medians) under a bootstrap
  that resamples the timing rounds, round r of every function together: the benchmarks
  time the functions in turn within a round (pallas_rs.bench.alternating), so a slow phase
  of the GPUs that lengthens one function's round lengthens the others' too, and
  consecutive iterations are not independent. Each list holds `rounds` rounds in order,
  nearly equal, the larger first (`timing.round_iterations`). None with fewer than two
  rounds or lists of different lengths."""
  n = len(t_fused)
  if rounds < 2 or n < rounds or len(t_gemm) != n or len(t_comm) != n:
    return None
  times = np.asarray([t_gemm, t_comm, t_fused], dtype=np.float64)
  blocks = np.array_split(np.arange(n), rounds)
  rng = np.random.default_rng(seed)
  draws_e = []
  for _ in range(draws):
    idx = np.concatenate([blocks[r] for r in rng.integers(0, rounds, rounds)])
    gemm, comm, fused = np.median(times[:, idx], axis=1)
    draws_e.append(overlap_efficiency(gemm, comm, fused))
  lo, hi = np.quantile(draws_e, [(1 - level) / 2, (1 + level) / 2])
  return float(lo), float(hi)


# ---------------------------------------------------------------------------
# Work and traffic.
# ---------------------------------------------------------------------------


def gemm_flops(m: int, k_shard: int, n: int) -> int:
  """FLOPs of one device's GEMM `[m, k_shard] @ [k_shard, n]`: 2 m k_shard n."""
  _check_dims(m=m, k_shard=k_shard, n=n)
  return 2 * int(m) * int(k_shard) * int(n)


def reduce_scatter_bus_bytes(m: int, n: int, num_devices: int,
                             itemsize: int) -> float:
  """Bytes per device of the reduce-scatter of `[m, n]`, NCCL busbw convention.

  NCCL's bus bandwidth for a reduce-scatter is `(D - 1) / D * S / t` with `S`
  the per-device input size `m * n * itemsize`: the bytes each device must
  send (and receive) in any algorithm, so the figure is comparable with the
  link bandwidth. Zero for D = 1.
  """
  _check_dims(m=m, n=n, num_devices=num_devices, itemsize=itemsize)
  return (num_devices - 1) / num_devices * m * n * itemsize


def achieved_tflops(flops: float, seconds: float) -> float:
  """TFLOP/s (1e12) from a FLOP count and a time in seconds."""
  _check_positive(seconds=seconds)
  if flops < 0 or not math.isfinite(flops):
    raise ValueError(f"{flops=} must be finite and >= 0")
  return flops / seconds / 1e12


def achieved_gbps(num_bytes: float, seconds: float) -> float:
  """GB/s (1e9) from a byte count and a time in seconds."""
  _check_positive(seconds=seconds)
  if num_bytes < 0 or not math.isfinite(num_bytes):
    raise ValueError(f"{num_bytes=} must be finite and >= 0")
  return num_bytes / seconds / 1e9


# ---------------------------------------------------------------------------
# Roofline estimates (labelled ESTIMATES; the tuner reuses them).
# ---------------------------------------------------------------------------


def estimate_t_gemm(m: int, k_shard: int, n: int, *,
                    peak_flops: float = MEASURED_PEAK_FLOPS_BF16) -> float:
  """Estimated seconds of one device's GEMM at `peak_flops` (an estimate)."""
  _check_positive(peak_flops=peak_flops)
  return gemm_flops(m, k_shard, n) / peak_flops


def estimate_t_comm(m: int, n: int, num_devices: int, itemsize: int = 2, *,
                    bus_bandwidth: float = MEASURED_RS_BUS_BANDWIDTH) -> float:
  """Estimated seconds of the reduce-scatter of `[m, n]` at `bus_bandwidth`.

  Bandwidth term only (no latency term): wrong by microseconds at small m,
  where synchronisation dominates. Zero for D = 1.
  """
  _check_positive(bus_bandwidth=bus_bandwidth)
  return reduce_scatter_bus_bytes(m, n, num_devices, itemsize) / bus_bandwidth


def roofline_estimates(m: int, k_shard: int, n: int, num_devices: int,
                       itemsize: int = 2, *,
                       peak_flops: float = MEASURED_PEAK_FLOPS_BF16,
                       bus_bandwidth: float = MEASURED_RS_BUS_BANDWIDTH
                       ) -> dict[str, float | str]:
  """Estimated T_gemm, T_comm and ideal max, in microseconds, labelled."""
  t_gemm = estimate_t_gemm(m, k_shard, n, peak_flops=peak_flops)
  t_comm = estimate_t_comm(m, n, num_devices, itemsize,
                           bus_bandwidth=bus_bandwidth)
  return {
      "label": ESTIMATE_LABEL,
      "peak_flops": peak_flops,
      "bus_bandwidth": bus_bandwidth,
      "t_gemm_us": t_gemm * 1e6,
      "t_comm_us": t_comm * 1e6,
      "t_ideal_us": max(t_gemm, t_comm) * 1e6,
  }


# ---------------------------------------------------------------------------
# Statistics of per-iteration times.
# ---------------------------------------------------------------------------


def summarize(times: Sequence[float]) -> dict[str, float | int]:
  """median, min, max, mean, std, p90, p95 and count of a list of times.

  Percentiles are numpy's default (linear interpolation). Raises ValueError on
  an empty list or on a NaN/inf/negative entry: a timer that produced one is
  broken, and a statistic over it would hide that.
  """
  arr = np.asarray(list(times), dtype=np.float64)
  if arr.ndim != 1 or arr.size == 0:
    raise ValueError(f"need a non-empty 1-D list of times, got shape {arr.shape}")
  if not np.all(np.isfinite(arr)) or np.any(arr < 0):
    raise ValueError(f"times must be finite and >= 0, got {arr.tolist()[:8]}...")
  return {
      "count": int(arr.size),
      "median": float(np.median(arr)),
      "min": float(arr.min()),
      "max": float(arr.max()),
      "mean": float(arr.mean()),
      "std": float(arr.std()),
      "p90": float(np.percentile(arr, 90)),
      "p95": float(np.percentile(arr, 95)),
  }
