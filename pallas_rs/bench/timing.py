"""Device-side timing of jitted functions, for the benchmark and the tuner.

Two timers, always named in the output (`Timing.timer`):

* ``"cupti"`` (GPU): `jax.experimental.mosaic.gpu.profiler.measure` with
  `aggregate=False`: CUPTI kernel records, i.e. device time of every kernel,
  excluding host dispatch and launch gaps. Compilation and warm-up calls are
  excluded.
* ``"host_wall_clock"`` (any backend; the only one on CPU): `time.perf_counter`
  around one call plus `jax.block_until_ready`, per iteration. It includes
  dispatch overhead and is for smoke runs only: no performance claims.

Multi-device rule (CUPTI). The records carry no device id and arrive device by
device, not iteration by iteration (`pallas_rs.bench.cupti`); where
`cupti.record_layout` finds that order, `cupti.pair_devices` gives each
iteration every device's kernels, device by device, and:

  step time (reported, `times_us`) = max over devices of the device's summed
      kernel time in that iteration: the slowest device.
  min across devices (`times_min_us`) = the same with the min: JAX's own
      choice (collective_matmul_mgpu: "the runtime that didn't include devices
      waiting for other devices"), the fastest device.

Where the order is not device by device (or the probe cannot tell), the legacy
rule runs and `Timing.rule` says so: each chunk is taken as one iteration of all
devices; a kernel name occurring `c * num_devices` times contributes the sum of
its c largest (step) / c smallest (min) durations.

Caveats, written into every multi-device record (`Timing.notes`): kernels that
overlap on several streams of one device (XLA's windowed einsum) are summed, so
their time is overstated. Each timing also carries `host_batch_us`: wall clock
of `iterations` back-to-back calls divided by `iterations`, an independent
cross-check of the step time.

If the names are not consistent across chunks (profiler.measure raises), each
iteration is measured in its own CUPTI session (`iterations=1`), at the cost of
a host sync between iterations; `Timing.notes` says so.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from pallas_rs.bench import cupti
from pallas_rs.tuning import metrics

TIMERS = ("auto", "cupti", "host_wall_clock")
DEFAULT_ITERATIONS = 200
DEFAULT_WARMUP = 2

Kernels = cupti.Kernels


@dataclasses.dataclass
class Timing:
  """Per-iteration times of one function, in microseconds.

  Attributes:
    timer: "cupti" or "host_wall_clock".
    times_us: per-iteration step time (max across devices, see module doc).
    times_min_us: per-iteration min across devices (None when not separable).
    device_times_us: per device, its summed kernel time per iteration (records
      paired with devices only; else None).
    rule: how per-device times were combined, in words.
    iterations: number of timed iterations.
    warmup: number of untimed calls after compilation.
    compile_s: seconds spent lowering + compiling (None if given compiled).
    host_batch_us: wall clock of `iterations` back-to-back calls / iterations
      (CUPTI timer only: a cross-check of the step time).
    kernels: kernel name -> launches per iteration, median and max us.
    notes: caveats that apply to these numbers.
  """
  timer: str
  times_us: list[float]
  times_min_us: list[float] | None
  rule: str
  iterations: int
  warmup: int
  compile_s: float | None = None
  host_batch_us: float | None = None
  kernels: dict[str, dict[str, float]] | None = None
  notes: list[str] = dataclasses.field(default_factory=list)
  device_times_us: list[list[float]] | None = None

  @property
  def median_us(self) -> float:
    return float(np.median(self.times_us))

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["stats"] = metrics.summarize(self.times_us)
    out["stats_min_across_devices"] = (
        metrics.summarize(self.times_min_us) if self.times_min_us else None)
    out["device_medians_us"] = (
        [float(np.median(t)) for t in self.device_times_us] if self.device_times_us else None)
    return out


def resolve_timer(timer: str = "auto") -> str:
  """"auto" -> "cupti" on a GPU backend with the Mosaic GPU extension, else host."""
  if timer not in TIMERS:
    raise ValueError(f"{timer=} must be one of {TIMERS}")
  if timer != "auto":
    return timer
  if jax.default_backend() == "gpu" and cupti.available():
    return "cupti"
  return "host_wall_clock"


def compile_function(fn: Callable[..., Any], args: Sequence[Any]):
  """Lowers and compiles `fn` for `args`; returns (compiled, seconds)."""
  if isinstance(fn, jax.stages.Compiled):
    return fn, None
  if not hasattr(fn, "lower"):
    fn = jax.jit(fn)
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def time_function(fn: Callable[..., Any], args: Sequence[Any], *,
                  iterations: int = DEFAULT_ITERATIONS,
                  warmup: int = DEFAULT_WARMUP, timer: str = "auto",
                  num_devices: int = 1) -> Timing:
  """Times `fn(*args)`: compile, `warmup` calls, then `iterations` timed calls.

  Args:
    fn: a jitted function (or a `jax.stages.Compiled`), called on `args`.
    args: its arguments (already on device, in their final sharding).
    iterations: timed iterations (>= 1).
    warmup: untimed calls after compilation (>= 0).
    timer: "auto", "cupti" or "host_wall_clock".
    num_devices: devices that run one step of `fn` (for the CUPTI rule).

  Returns:
    A `Timing`. Raises RuntimeError if CUPTI saw no kernel at all.
  """
  if iterations < 1:
    raise ValueError(f"{iterations=} must be >= 1")
  if warmup < 0:
    raise ValueError(f"{warmup=} must be >= 0")
  if num_devices < 1:
    raise ValueError(f"{num_devices=} must be >= 1")
  timer = resolve_timer(timer)
  compiled, compile_s = compile_function(fn, args)
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  if timer == "host_wall_clock":
    # No back-to-back batch here: on CPU, many in-flight calls with
    # collectives starve the host devices' rendezvous (XLA aborts after 40 s).
    times = _host_times_us(compiled, args, iterations)
    return Timing(
        timer=timer, times_us=times, times_min_us=None,
        rule=("host wall clock per call incl. dispatch, block_until_ready on "
              "all outputs (all devices): no performance claims"),
        iterations=iterations, warmup=warmup, compile_s=compile_s)
  sessions = _session_sizes(iterations, calls_in_flight(output_bytes(compiled)))
  per_iter, notes, paired, batch = [], [], [], 0.0
  for calls in sessions:
    batch += host_batch_us(compiled, args, calls) * calls
    its, session_notes, session_paired = cupti.session_kernels(compiled, args, calls,
                                                              num_devices)
    per_iter += its
    notes += [n for n in session_notes if n not in notes]
    paired.append(session_paired)
  if len(sessions) > 1:
    notes.append(f"{len(sessions)} CUPTI sessions of <= {sessions[0]} calls (each session "
                 f"holds its calls' outputs: <= {MAX_OUTPUT_BYTES_IN_FLIGHT >> 20} MiB)")
  timing = kernels_to_timing(per_iter, num_devices, paired=all(paired))
  timing.iterations, timing.warmup = iterations, warmup
  timing.compile_s, timing.host_batch_us = compile_s, batch / iterations
  timing.notes = notes + timing.notes
  return timing


# Outputs that timed calls may hold at once, per device: profiler.measure keeps every call's
# outputs until its session ends. Beyond memory (a loopback D = 8 output at M = 32768 is 4.3 GB:
# 200 calls would not fit an H200), a session that holds GiB is a long run of calls back to back,
# and those run slower: a 56 us GEMM with 6 MiB outputs traced over 2000 calls in one session
# stepped up ~10%, and was flat in sessions of 100 calls (600 MiB); a 1.5 ms GEMM ran 5-12% slower
# in sessions of up to 16 GiB than of 512 MiB (one H100, BUILD_NOTES, eighty-second session; 9-16%
# on one H200, eighty-third), its SM clock down from 1965 to a median 1575 MHz under the power cap
# (eighty-fourth). Up to 32 GiB held apart from the timed calls, adding no busy time, cost nothing.
MAX_OUTPUT_BYTES_IN_FLIGHT = 512 << 20


def calls_in_flight(nbytes: int | None) -> int | None:
  """How many calls of `nbytes` of outputs per device fit MAX_OUTPUT_BYTES_IN_FLIGHT: one
  CUPTI session's calls (at least 1; None: the outputs' size unknown, no limit)."""
  return max(1, MAX_OUTPUT_BYTES_IN_FLIGHT // nbytes) if nbytes else None


def output_bytes(compiled) -> int | None:
  """Bytes of one call's outputs per device (None if the function does not say)."""
  try:
    infos = jax.tree.leaves(compiled.out_info)
  except AttributeError:
    return None
  nbytes = 0
  for info in infos:
    shape = info.shape
    if getattr(info, "sharding", None) is not None:
      shape = info.sharding.shard_shape(shape)
    nbytes += int(np.prod(shape)) * np.dtype(info.dtype).itemsize
  return nbytes


def _session_sizes(iterations: int, limit: int | None) -> list[int]:
  """`iterations` as CUPTI sessions of at most `limit` calls, nearly equal, larger first."""
  return round_iterations(iterations, 1 if limit is None else -(-iterations // limit))


def round_iterations(iterations: int, rounds: int) -> list[int]:
  """`iterations` split into `rounds` nearly equal parts, the larger first."""
  if not 1 <= rounds <= iterations:
    raise ValueError(f"rounds={rounds} must be in [1, iterations={iterations}]")
  q, r = divmod(iterations, rounds)
  return [q + (i < r) for i in range(rounds)]


def _host_times_us(compiled, args, iterations: int) -> list[float]:
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) * 1e6)
  return times


def host_batch_us(compiled, args, iterations: int) -> float:
  t0 = time.perf_counter()
  outs = [compiled(*args) for _ in range(iterations)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - t0) * 1e6 / iterations


def kernel_split_us(kernels: dict[str, dict[str, float]], part: str,
                    num_devices: int = 1) -> tuple[float, float]:
  """(us per iteration and device of the kernels whose name contains `part`, of all the others)
  from `Timing.kernels` (launches x median; records pooled over `num_devices`). What a call
  launches besides its main kernel: a D > 1 Mosaic call's zero-fill of its semaphores (jax's
  `pl.get_global` scratch, a `loop_broadcast_fusion`: BUILD_NOTES 2026-12-07, 106th)."""
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  inside = outside = 0.0
  for name, info in kernels.items():
    us = info["count_per_iteration"] * info["median_us"] / num_devices
    if part in name:
      inside += us
    else:
      outside += us
  return inside, outside


def kernels_to_timing(per_iter: Sequence[Kernels], num_devices: int, *,
                      paired: bool = False) -> Timing:
  """Applies the multi-device rule of the module docstring to CUPTI records.

  Args:
    per_iter: for each iteration, its (kernel name, ms) records of all devices.
    num_devices: devices that ran each iteration.
    paired: each iteration's records are device by device, in equal runs
      (`cupti.pair_devices`): the exact rule. Else the legacy rule by kernel name.

  Returns:
    A `Timing` with timer="cupti" (iterations/warmup/compile left at 0/None).
  """
  if not per_iter:
    raise ValueError("no iterations to combine")
  pooled: dict[str, list[float]] = collections.defaultdict(list)
  for kernels in per_iter:
    for name, ms in kernels:
      pooled[name].append(ms * 1e3)
  counts0 = collections.Counter(name for name, _ in per_iter[0])
  kernels_json = {
      name[:160]: {
          "count_per_iteration": counts0.get(name, 0),
          "median_us": float(np.median(v)),
          "max_us": float(np.max(v)),
      } for name, v in pooled.items()
  }
  if paired and num_devices > 1:
    per_device = [_device_sums(kernels, num_devices) for kernels in per_iter]
    return Timing(
        timer="cupti", times_us=[max(t) for t in per_device],
        times_min_us=[min(t) for t in per_device],
        rule=(f"{num_devices} devices, records paired with devices (CUPTI's order, "
              "cupti.record_layout): per iteration, max (step) / min over devices of "
              "the device's summed kernel time; see pallas_rs/bench/timing.py"),
        iterations=len(per_iter), warmup=0, kernels=kernels_json,
        notes=["kernels overlapping on several streams of a device are summed "
               "(overstated); compare with host_batch_us"],
        device_times_us=[list(t) for t in zip(*per_device)])
  times, times_min = [], []
  separable = all(
      count % num_devices == 0
      for kernels in per_iter
      for count in collections.Counter(name for name, _ in kernels).values())
  for kernels in per_iter:
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, ms in kernels:
      by_name[name].append(ms * 1e3)
    step, fastest = 0.0, 0.0
    for durations in by_name.values():
      durations.sort()
      c = max(len(durations) // num_devices, 1)
      step += sum(durations[-c:])
      fastest += sum(durations[:c])
    if not separable:
      # Cannot pair records with devices: report the per-device mean.
      step = sum(sum(v) for v in by_name.values()) / num_devices
    times.append(step)
    times_min.append(fastest)
  notes = []
  if num_devices == 1:
    rule = "one device: sum of the iteration's kernel durations"
  elif separable:
    rule = (f"{num_devices} devices, records not paired with devices (legacy rule): per "
            "kernel name, sum of the c largest (step) / c smallest (min) of its "
            "c*num_devices durations in the chunk; see pallas_rs/bench/timing.py")
    notes.append("multi-device CUPTI legacy rule: a chunk is taken as one iteration of "
                 "every device, which holds only where CUPTI orders records by "
                 "iteration; upper bound for multi-kernel steps; kernels overlapping "
                 "on several streams are summed (overstated); compare with host_batch_us")
  else:
    rule = (f"{num_devices} devices, kernel counts not divisible by "
            "num_devices: step = total kernel time / num_devices (mean), no "
            "min")
    notes.append("kernel records could not be split across devices")
  return Timing(timer="cupti", times_us=times,
                times_min_us=times_min if separable else None, rule=rule,
                iterations=len(times), warmup=0, kernels=kernels_json, notes=notes)


def _device_sums(kernels: Kernels, num_devices: int) -> list[float]:
  """Per device, its summed kernel time (us) in one paired iteration."""
  k = len(kernels) // num_devices
  return [sum(ms for _, ms in kernels[d * k:(d + 1) * k]) * 1e3 for d in range(num_devices)]
