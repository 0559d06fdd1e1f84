"""Several functions timed in turn, for comparisons: the benchmark harness, the tuner's
experiments and the probes.

A GPU's speed drifts: the slow phases seen on two H200s come and go over 0.1-0.4 s
(BUILD_NOTES, seventy-seventh session), so functions timed one after another in blocks
compare different phases. `time_alternating` times them in rounds and, with CUPTI, call by
call in turn within each round (one CUPTI session per round), so that a phase falls on every
function alike.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import logging
import jax
import numpy as np

from pallas_rs.bench import cupti
from pallas_rs.bench import timing
from pallas_rs.bench.timing import DEFAULT_WARMUP, Timing


def time_alternating(items: Mapping[Any, tuple[Any, Sequence[Any]]], *, iterations: int,
                     rounds: int, warmup: int = DEFAULT_WARMUP, timer: str = "auto",
                     num_devices: int = 1,
                     on_error: Callable[[Any, Exception], None] | None = None,
                     interleave: bool = True) -> dict[Any, Timing]:
  """Times every function of `items` (key -> (compiled function, args), or (function, args,
  its num_devices)) for `iterations` calls in `rounds` rounds, so that a slow phase of the
  GPUs falls on all of them alike; key -> the merged `Timing` (`merge_rounds`).

  With CUPTI and `interleave`, each round is one CUPTI session in which the functions run
  call by call in turn (`cupti.interleaved_kernels`; on several devices a scalar psum,
  not counted, lines the devices up before each call); otherwise, or where the records
  cannot be split that way (the reason goes into the notes), each round times each function's
  calls back to back. A function that raises is dropped after `on_error(key, exception)`;
  without `on_error` the exception propagates."""
  timer, fallback, compile_s = timing.resolve_timer(timer), None, {}
  if interleave and timer == "cupti" and len(items) > 1:
    items, compile_s = _compiled_and_warm(items, warmup, num_devices, on_error)
    timed, fallback = _time_interleaved(items, iterations, rounds, warmup)
    if timed is not None:
      for key, t in timed.items():
        t.compile_s = compile_s[key]
      return timed
    logging.warning("timing rounds of consecutive calls: %s", fallback)
    warmup = 0
  parts: dict[Any, list[Timing]] = {key: [] for key in items}
  for i, calls in enumerate(timing.round_iterations(iterations, rounds)):
    for key, (fn, args, *devices) in items.items():
      if key not in parts:
        continue
      try:
        parts[key].append(timing.time_function(
            fn, args, iterations=calls, warmup=warmup if i == 0 else 0, timer=timer,
            num_devices=devices[0] if devices else num_devices))
      except Exception as e:  # pylint: disable=broad-except
        if on_error is None:
          raise
        on_error(key, e)
        del parts[key]
  merged = {key: merge_rounds(timings) for key, timings in parts.items()}
  for key, t in merged.items():
    t.notes += [fallback] if fallback else []
    t.compile_s = compile_s.get(key, t.compile_s)
  return merged


def _compiled_and_warm(items, warmup: int, num_devices: int, on_error):
  """items -> ({key: (compiled, args, num_devices)}, {key: compile seconds}) after `warmup`
  calls each; a function that raises is dropped after `on_error` (or the error propagates)."""
  ready, compile_s = {}, {}
  for key, (fn, args, *devices) in items.items():
    try:
      compiled, compile_s[key] = timing.compile_function(fn, args)
      for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    except Exception as e:  # pylint: disable=broad-except
      if on_error is None:
        raise
      on_error(key, e)
      continue
    ready[key] = (compiled, args, devices[0] if devices else num_devices)
  return ready, compile_s


# How a record says which way it was timed (its `rule`), and why not call by call (its notes).
INTERLEAVED_RULE = "timed call by call in turn with the other candidates"
NOT_INTERLEAVED = ": not interleaved"
_INTERLEAVED = f"; {INTERLEAVED_RULE}, one CUPTI session per round"


def _time_interleaved(items, iterations: int, rounds: int, warmup: int
                      ) -> tuple[dict[Any, Timing] | None, str | None]:
  """`time_alternating`'s interleaved rounds over compiled, warm `items`: (timings, None), or
  (None, why not) where the records cannot be split call by call."""
  if not items:
    return {}, None
  counts = {nd for _, _, nd in items.values()}
  if len(counts) != 1:
    return None, "functions on different numbers of devices" + NOT_INTERLEAVED
  nd = counts.pop()
  calls = [(compiled, args) for compiled, args, _ in items.values()]
  try:
    if nd > 1:
      sync = cupti.sync_call([args for _, args in calls], nd)
      if sync is None:
        return None, f"arguments not on {nd} devices{NOT_INTERLEAVED}"
      calls = [c for call in calls for c in (sync, call)]
    names = [cupti.kernel_names(fn, args, nd) for fn, args in calls]
    if None in names:
      return None, "kernel records not told apart by device" + NOT_INTERLEAVED
    # A session holds its calls' outputs, and each device's records must fit one buffer.
    nbytes = sum(timing.output_bytes(c) or 0 for c, _, _ in items.values())
    per_session = min(timing.calls_in_flight(nbytes) or iterations,
                      cupti.MAX_RECORDS_PER_BUFFER // sum(map(len, names)))
    if per_session < 1:
      return None, ("a cycle of the calls has too many kernels for one session"
                    + NOT_INTERLEAVED)
    limit = -(-iterations // per_session)
    parts: dict[Any, list[Timing]] = {key: [] for key in items}
    for n in timing.round_iterations(iterations, min(iterations, max(rounds, limit))):
      batch = {key: timing.host_batch_us(c, a, n) for key, (c, a, _) in items.items()}
      got = cupti.interleaved_kernels(calls, names, n, nd)
      if got is None:
        return None, "records did not split into cycles of the calls" + NOT_INTERLEAVED
      for key, per_iter in zip(items, got[1::2] if nd > 1 else got):
        t = timing.kernels_to_timing(per_iter, nd, paired=nd > 1)
        t.rule += _INTERLEAVED + (" (a scalar psum, not counted, before each call lines "
                                  "the devices up)" if nd > 1 else "")
        t.iterations, t.warmup, t.host_batch_us = n, warmup, batch[key]
        parts[key].append(t)
  except Exception as e:  # pylint: disable=broad-except
    return None, f"interleaving failed ({type(e).__name__}: {e}){NOT_INTERLEAVED}"
  return {key: merge_rounds(ts) for key, ts in parts.items()}, None


def merge_rounds(rounds: Sequence[Timing]) -> Timing:
  """One `Timing` from the rounds of one function timed in turn with others
  (`time_alternating`): times concatenated in round order; per kernel, the max and the median of
  the rounds' medians; `host_batch_us` weighted by iterations."""
  if not rounds:
    raise ValueError("no rounds to merge")
  first = rounds[0]
  if any(t.timer != first.timer for t in rounds):
    raise ValueError(f"rounds with different timers: {[t.timer for t in rounds]}")
  iterations = sum(t.iterations for t in rounds)
  batches = [t.host_batch_us for t in rounds]
  kernels = None
  if all(t.kernels for t in rounds):
    kernels = {name: {"count_per_iteration": info["count_per_iteration"],
                      "median_us": float(np.median([t.kernels[name]["median_us"]
                                                    for t in rounds if name in t.kernels])),
                      "max_us": max(t.kernels[name]["max_us"]
                                    for t in rounds if name in t.kernels)}
               for name, info in first.kernels.items()}
  devices = [t.device_times_us for t in rounds]
  return Timing(
      timer=first.timer, times_us=[x for t in rounds for x in t.times_us],
      times_min_us=(None if any(t.times_min_us is None for t in rounds)
                    else [x for t in rounds for x in t.times_min_us]),
      rule=first.rule + (f"; {len(rounds)} rounds, alternating with the other candidates"
                         if len(rounds) > 1 else ""),
      iterations=iterations, warmup=first.warmup, compile_s=first.compile_s,
      host_batch_us=(None if None in batches else
                     sum(b * t.iterations for b, t in zip(batches, rounds)) / iterations),
      kernels=kernels, notes=list(dict.fromkeys(n for t in rounds for n in t.notes)),
      device_times_us=(None if None in devices else
                       [[x for part in parts for x in part] for parts in zip(*devices)]))
