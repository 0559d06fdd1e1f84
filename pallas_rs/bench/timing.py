"""Device-side timing of jitted functions, for the benchmark and the tuner.

Two timers, always named in the output (`Timing.timer`):

* ``"cupti"`` (GPU): `jax.experimental.mosaic.gpu.profiler.measure` with
  `aggregate=False`: CUPTI kernel records, i.e. device time of every kernel,
  excluding host dispatch and launch gaps. Compilation and warm-up calls are
  excluded.
* ``"host_wall_clock"`` (any backend; the only one on CPU): `time.perf_counter`
  around one call plus `jax.block_until_ready`, per iteration. It includes
  dispatch overhead and is for smoke runs only: no performance claims.

Multi-device rule (CUPTI). The Mosaic GPU CUPTI extension returns
`(kernel_name, ms)` records for *all* devices of the process, without a device
id (jaxlib: "TODO(andportnoy) handle multi-GPU"). `profiler.measure` splits
the records into `iterations` equal consecutive chunks and checks that kernel
names repeat identically chunk to chunk. Within one chunk (one iteration, all
devices) we rely on every device running the same SPMD program, so each
kernel name occurs `c * num_devices` times (c launches per device). Then:

  step time (reported, `times_us`) = sum over kernel names of the sum of its
      c largest durations: the time of a device that was the slowest in every
      kernel. Exact for a one-kernel step (the fused kernel, the NCCL
      reduce-scatter alone, the GEMM alone); an upper bound on the true
      max-over-devices otherwise.
  min across devices (`times_min_us`) = the same with the c smallest: JAX's own
      choice (collective_matmul_mgpu: "the runtime that didn't include devices
      waiting for other devices"), a lower bound on the fastest device.

Two caveats, written into every multi-device record (`Timing.notes`):
kernels that overlap on several streams of one device (XLA's windowed einsum)
are summed, so their time is overstated; and the chunking assumes records
arrive iteration by iteration. Each timing therefore also carries
`host_batch_us`: wall clock of `iterations` back-to-back calls divided by
`iterations`, an independent cross-check of the step time.

If the names are not consistent across chunks (profiler.measure raises), each
iteration is measured in its own CUPTI session (`iterations=1`), which makes
the per-iteration grouping exact at the cost of a host sync between
iterations; `Timing.notes` says so.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
import dataclasses
import inspect
import time
from typing import Any

import jax
import numpy as np

from pallas_rs.tuning import metrics

TIMERS = ("auto", "cupti", "host_wall_clock")
DEFAULT_ITERATIONS = 200
DEFAULT_WARMUP = 2

Kernels = list[tuple[str, float]]  # one iteration: (kernel name, ms)


@dataclasses.dataclass
class Timing:
  """Per-iteration times of one function, in microseconds.

  Attributes:
    timer: "cupti" or "host_wall_clock".
    times_us: per-iteration step time (max across devices, see module doc).
    times_min_us: per-iteration min across devices (None when not separable).
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

  @property
  def median_us(self) -> float:
    return float(np.median(self.times_us))

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["stats"] = metrics.summarize(self.times_us)
    out["stats_min_across_devices"] = (
        metrics.summarize(self.times_min_us) if self.times_min_us else None)
    return out


def resolve_timer(timer: str = "auto") -> str:
  """"auto" -> "cupti" on a GPU backend with the Mosaic GPU extension, else host."""
  if timer not in TIMERS:
    raise ValueError(f"{timer=} must be one of {TIMERS}")
  if timer != "auto":
    return timer
  if jax.default_backend() == "gpu" and _cupti_available():
    return "cupti"
  return "host_wall_clock"


def _cupti_available() -> bool:
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # pylint: disable=g-import-not-at-top
    from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return mosaic_gpu_lib is not None


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
  host_batch_us = _host_batch_us(compiled, args, iterations)
  per_iter, notes = _cupti_kernels(compiled, args, iterations)
  timing = kernels_to_timing(per_iter, num_devices)
  timing.iterations, timing.warmup = iterations, warmup
  timing.compile_s, timing.host_batch_us = compile_s, host_batch_us
  timing.notes = notes + timing.notes
  return timing


def _host_times_us(compiled, args, iterations: int) -> list[float]:
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) * 1e6)
  return times


def _host_batch_us(compiled, args, iterations: int) -> float:
  t0 = time.perf_counter()
  outs = [compiled(*args) for _ in range(iterations)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - t0) * 1e6 / iterations


def _measure_params() -> Any:
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  return profiler, inspect.signature(profiler.measure).parameters


def _cupti_kernels(compiled, args, iterations: int
                   ) -> tuple[list[Kernels], list[str]]:
  """Per-iteration kernel lists via profiler.measure, guarded across versions.

  jax 0.10.2 and 0.11.2: `measure(f, *, aggregate, iterations)`; older jax had
  `mode=` and no `iterations` (then one session per iteration).
  """
  profiler, params = _measure_params()
  kwargs: dict[str, Any] = {"aggregate": False}
  if "mode" in params:
    kwargs["mode"] = "cupti"
  notes: list[str] = []
  if "iterations" in params and iterations > 1:
    try:
      _, timings = profiler.measure(compiled, iterations=iterations,
                                    **kwargs)(*args)
      return _as_iterations(timings, iterations), notes
    except RuntimeError as e:
      # Narrow: only measure()'s own chunking checks send us to the fallback.
      if ("not consistent across iterations" not in str(e)
          and "not divisible by the number of iterations" not in str(e)):
        raise
      notes.append(f"profiler.measure chunking failed ({e}); one CUPTI "
                   "session per iteration instead (host sync in between)")
  per_iter = []
  for _ in range(iterations):
    _, timings = profiler.measure(compiled, **kwargs)(*args)
    per_iter.extend(_as_iterations(timings, 1))
  return per_iter, notes


def _as_iterations(timings, iterations: int) -> list[Kernels]:
  if not timings:
    raise RuntimeError("CUPTI recorded no kernel: nothing ran on the GPU?")
  if isinstance(timings[0], tuple):  # a single iteration's flat list
    timings = [timings]
  if len(timings) != iterations:
    raise RuntimeError(f"expected {iterations} iterations, got {len(timings)}")
  return [[(str(name), float(ms)) for name, ms in it] for it in timings]


def kernels_to_timing(per_iter: Sequence[Kernels], num_devices: int) -> Timing:
  """Applies the multi-device rule of the module docstring to CUPTI records.

  Args:
    per_iter: for each iteration, its (kernel name, ms) records of all devices.
    num_devices: devices that ran each iteration.

  Returns:
    A `Timing` with timer="cupti" (iterations/warmup/compile left at 0/None).
  """
  if not per_iter:
    raise ValueError("no iterations to combine")
  times, times_min = [], []
  pooled: dict[str, list[float]] = collections.defaultdict(list)
  counts0 = collections.Counter(name for name, _ in per_iter[0])
  separable = all(
      count % num_devices == 0
      for kernels in per_iter
      for count in collections.Counter(name for name, _ in kernels).values())
  for kernels in per_iter:
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, ms in kernels:
      by_name[name].append(ms * 1e3)
      pooled[name].append(ms * 1e3)
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
    rule = (f"{num_devices} devices, records without device ids: per kernel "
            "name, sum of the c largest (step, max rule) / c smallest (min "
            "rule) of its c*num_devices durations; see pallas_rs/bench/timing.py")
    notes.append("multi-device CUPTI rule: exact for one-kernel steps, upper "
                 "bound otherwise; kernels overlapping on several streams are "
                 "summed (overstated); compare with host_batch_us")
  else:
    rule = (f"{num_devices} devices, kernel counts not divisible by "
            "num_devices: step = total kernel time / num_devices (mean), no "
            "min")
    notes.append("kernel records could not be split across devices")
  kernels = {
      name[:160]: {
          "count_per_iteration": counts0.get(name, 0),
          "median_us": float(np.median(v)),
          "max_us": float(np.max(v)),
      } for name, v in pooled.items()
  }
  return Timing(timer="cupti", times_us=times,
                times_min_us=times_min if separable else None, rule=rule,
                iterations=len(times), warmup=0, kernels=kernels, notes=notes)
