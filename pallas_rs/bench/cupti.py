"""CUPTI kernel records of a timed function, and which device and iteration each belongs to.

The Mosaic GPU extension's CUPTI session returns `(kernel_name, ms)` records for *all* devices
of the process, without a device id (jaxlib: "TODO(andportnoy) handle multi-GPU"), appended
buffer by buffer as CUPTI completes them; `profiler.measure` splits them into `iterations`
equal consecutive chunks as if they arrived iteration by iteration. On the GPU hosts measured
they arrive device by device (each device's buffer in one run: BUILD_NOTES, seventy-seventh
session), so a chunk held consecutive iterations of one device. `record_layout` checks the
order once per process with marker kernels; where each device's records come in one run,
`pair_devices` regroups them so that each iteration holds every device's kernels, device by
device (`pallas_rs.bench.timing` turns them into step times). `interleaved_kernels` runs
several functions call by call in one session and `split_cycles` gives each call its records
(`pallas_rs.bench.alternating`).
"""
from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Kernels = list[tuple[str, float]]  # one iteration: (kernel name, ms)


def available() -> bool:
  """Whether this jaxlib has the Mosaic GPU extension that holds CUPTI."""
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # pylint: disable=g-import-not-at-top
    from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return mosaic_gpu_lib is not None


def _measure_params() -> Any:
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  return profiler, inspect.signature(profiler.measure).parameters


def session_kernels(compiled, args, iterations: int, num_devices: int = 1
                    ) -> tuple[list[Kernels], list[str], bool]:
  """Per-iteration kernel lists of `iterations` calls in one CUPTI session, via
  profiler.measure, guarded across versions.

  jax 0.10.2 and 0.11.2: `measure(f, *, aggregate, iterations)`; older jax had
  `mode=` and no `iterations` (then one session per iteration). Returns the
  lists, notes and whether each list holds every device's records device by
  device (`pair_devices`; then timing's `kernels_to_timing(..., paired=True)`).
  """
  profiler, params = _measure_params()
  kwargs: dict[str, Any] = {"aggregate": False}
  if "mode" in params:
    kwargs["mode"] = "cupti"
  notes: list[str] = []
  sessions: list[list[Kernels]] = []
  if "iterations" in params and iterations > 1:
    try:
      _, timings = profiler.measure(compiled, iterations=iterations,
                                    **kwargs)(*args)
      sessions = [_as_iterations(timings, iterations)]
    except RuntimeError as e:
      # Narrow: only measure()'s own chunking checks send us to the fallback.
      if ("not consistent across iterations" not in str(e)
          and "not divisible by the number of iterations" not in str(e)):
        raise
      notes.append(f"profiler.measure chunking failed ({e}); one CUPTI "
                   "session per iteration instead (host sync in between)")
  if not sessions:
    for _ in range(iterations):
      _, timings = profiler.measure(compiled, **kwargs)(*args)
      sessions.append(_as_iterations(timings, 1))
  per_iter = [it for session in sessions for it in session]
  if num_devices == 1:
    return per_iter, notes, False
  layout = record_layout()
  if layout == DEVICE_MAJOR:
    paired = [pair_devices([r for it in session for r in it], num_devices, len(session))
              for session in sessions]
    if all(p is not None for p in paired):
      return [it for p in paired for it in p], notes, True
    notes.append("CUPTI records did not split into equal runs per device: legacy rule")
  else:
    notes.append(f"CUPTI record order across devices: {layout} (record_layout): legacy rule")
  return per_iter, notes, False


# How one CUPTI session's records are ordered across devices (`record_layout`).
DEVICE_MAJOR = "device_major"  # each device's records in one run
INTERLEAVED = "interleaved"  # not device by device: the legacy chunking
UNKNOWN = "unknown"  # the probe could not run or could not tell
_PROBE_ROUNDS = 8


def classify_layout(names: Sequence[str], rounds: int) -> str:
  """The probe's verdict from its record names: device 0 ran one marker kernel
  `rounds` times, every other device another, issued round-robin. DEVICE_MAJOR
  if each run of equal names is a whole number of devices' worth (`rounds`),
  INTERLEAVED if not, UNKNOWN if the markers cannot be told apart."""
  if len(set(names)) != 2 or len(names) % rounds:
    return UNKNOWN
  runs = [len(list(group)) for _, group in itertools.groupby(names)]
  return DEVICE_MAJOR if all(r % rounds == 0 for r in runs) else INTERLEAVED


@functools.cache
def record_layout() -> str:
  """How CUPTI orders one session's kernel records across this process's GPUs (probed
  once, `probe_layout`); UNKNOWN with fewer than two GPUs."""
  devices = [d for d in jax.local_devices() if d.platform == "gpu"]
  return probe_layout(devices) if len(devices) >= 2 else UNKNOWN


def probe_layout(devices: Sequence[Any]) -> str:
  """`sin` on devices[0] and `cos` on the others, issued round-robin in one CUPTI session
  (the Mosaic GPU extension's own, as `profiler.measure` opens it), classified by
  `classify_layout`; UNKNOWN if the session cannot run. (One GPU listed twice runs both
  markers on one stream: INTERLEAVED, a check of the probe itself.)"""
  try:
    ext = _extension()
    marks = [jax.jit(jnp.sin), jax.jit(jnp.cos)]
    calls = [(marks[min(i, 1)], jax.device_put(jnp.ones((4096,), jnp.float32), d))
             for i, d in enumerate(devices)]
    for f, x in calls:
      jax.block_until_ready(f(x))
    ext._cupti_init()  # pylint: disable=protected-access
    try:
      jax.block_until_ready([f(x) for _ in range(_PROBE_ROUNDS) for f, x in calls])
    finally:
      records = ext._cupti_get_timings(True)  # pylint: disable=protected-access
  except (AttributeError, ImportError, RuntimeError):
    return UNKNOWN
  return classify_layout([str(name) for name, _ in records or []], _PROBE_ROUNDS)


# Kernel records one 10 MiB activity buffer of the extension surely holds (a CUpti_ActivityKernel
# record is a few hundred bytes): a session's run per device must fit one buffer to be whole.
MAX_RECORDS_PER_BUFFER = 10_000


def pair_devices(records: Kernels, num_devices: int, iterations: int
                 ) -> list[Kernels] | None:
  """One session's records, device by device (DEVICE_MAJOR), regrouped per
  iteration: iteration i = device 0's kernels of its iteration i, then device
  1's, ... None unless they split into `num_devices` equal runs of `iterations`
  identical kernel-name sequences (every device runs the same SPMD program), or if
  a device's records could have filled more than one activity buffer (then the
  runs could interleave buffer by buffer)."""
  per_device, rem = divmod(len(records), num_devices)
  k, rem2 = divmod(per_device, iterations)
  if rem or rem2 or k == 0 or per_device > MAX_RECORDS_PER_BUFFER:
    return None
  names = [name for name, _ in records[:k]]
  chunks = [records[j * k:(j + 1) * k] for j in range(num_devices * iterations)]
  if any([name for name, _ in chunk] != names for chunk in chunks):
    return None
  return [[r for d in range(num_devices) for r in chunks[d * iterations + i]]
          for i in range(iterations)]


def _extension():
  """The Mosaic GPU extension that opens CUPTI sessions (ImportError/AttributeError if none)."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # pylint: disable=g-import-not-at-top
  return mosaic_gpu_lib._mosaic_gpu_ext  # pylint: disable=protected-access


def kernel_names(compiled, args, num_devices: int = 1) -> list[str] | None:
  """The kernels one call of `compiled(*args)` runs on one device, in order (a CUPTI session
  of one call); None where several devices' records cannot be told apart or differ."""
  per_iter, _, paired = session_kernels(compiled, args, 1, num_devices)
  if num_devices > 1 and not paired:
    return None
  return [name for name, _ in per_iter[0][:len(per_iter[0]) // num_devices]]


def interleaved_kernels(calls: Sequence[tuple[Any, Sequence[Any]]],
                        names: Sequence[Sequence[str]], iterations: int,
                        num_devices: int = 1) -> list[list[Kernels]] | None:
  """One CUPTI session of `iterations` cycles, each calling every `(function, args)` of
  `calls` once, in turn; per function, per iteration, its records device by device (as
  `pair_devices` gives them). `names[j]`: function j's kernels on one device
  (`kernel_names`). None if the records do not split into those cycles."""
  ext = _extension()
  ext._cupti_init()  # pylint: disable=protected-access
  try:
    jax.block_until_ready([fn(*args) for _ in range(iterations) for fn, args in calls])
  finally:
    records = ext._cupti_get_timings(True)  # pylint: disable=protected-access
  if num_devices > 1 and record_layout() != DEVICE_MAJOR:
    return None
  return split_cycles([(str(n), float(ms)) for n, ms in records or []], names, iterations,
                      num_devices)


def split_cycles(records: Kernels, names: Sequence[Sequence[str]], iterations: int,
                 num_devices: int = 1) -> list[list[Kernels]] | None:
  """Records of `iterations` cycles of the functions whose per-device kernels are `names`,
  device by device (DEVICE_MAJOR; one device: in order), regrouped: [function][iteration]
  -> that call's records, device by device. None unless every device's run is exactly
  `iterations` repetitions of the cycle and fits one activity buffer."""
  cycle = [name for function in names for name in function]
  per_device = iterations * len(cycle)
  if (not cycle or len(records) != num_devices * per_device
      or per_device > MAX_RECORDS_PER_BUFFER
      or [name for name, _ in records] != cycle * (num_devices * iterations)):
    return None
  starts = list(itertools.accumulate([0] + [len(f) for f in names]))
  return [[[r for d in range(num_devices)
            for r in records[(d * iterations + i) * len(cycle) + starts[j]:
                             (d * iterations + i) * len(cycle) + starts[j + 1]]]
           for i in range(iterations)] for j in range(len(names))]


def sync_call(args: Sequence[Any], num_devices: int):
  """A scalar psum over the devices that `args`' arrays live on, compiled, with its argument:
  (function, args), or None unless they are `num_devices` devices. Called before each
  function of an interleaved cycle (its records dropped), it lines the devices up, so
  that a function's first collective does not wait out the skew that an independent
  function before it (XLA's GEMM alone) left between the devices."""
  devices = tuple(sorted({d for a in jax.tree.leaves(args) if hasattr(a, "sharding")
                          for d in a.sharding.device_set}, key=lambda d: d.id))
  return _sync_program(devices) if len(devices) == num_devices else None


@functools.cache
def _sync_program(devices: tuple[Any, ...]):
  """`sync_call`'s psum on `devices`, compiled once per process (not once per timed shape)."""
  mesh = jax.sharding.Mesh(np.array(devices), ("sync",))
  spec = jax.sharding.PartitionSpec("sync")
  x = jax.device_put(jnp.zeros((len(devices),), jnp.float32),
                     jax.sharding.NamedSharding(mesh, spec))
  psum = jax.shard_map(lambda v: jax.lax.psum(v, "sync"), mesh=mesh, in_specs=spec,
                       out_specs=spec)
  return jax.jit(psum).lower(x).compile(), (x,)


def _as_iterations(timings, iterations: int) -> list[Kernels]:
  if not timings:
    raise RuntimeError("CUPTI recorded no kernel: nothing ran on the GPU?")
  if isinstance(timings[0], tuple):  # a single iteration's flat list
    timings = [timings]
  if len(timings) != iterations:
    raise RuntimeError(f"expected {iterations} iterations, got {len(timings)}")
  return [[(str(name), float(ms)) for name, ms in it] for it in timings]
