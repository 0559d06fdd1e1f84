"""One-GPU checks of the fused kernel: correctness (loopback D in {2,4,8}, D = 1) and timing.

  PYTHONPATH=. python experiments/kernel_check.py --what=correct --out=/tmp/kc.json
  PYTHONPATH=. python experiments/kernel_check.py --what=perf --out=/tmp/kc_perf.json

Correctness: fresh random bf16 inputs (distinct per rank), every output element compared with a
float64 numpy reference; the unfused XLA path (f32-accumulated dot, cast, sum in bf16 over
sources, as NCCL's reduce-scatter would) is measured on the same inputs, and the rule is
err_fused <= 1.1 * err_xla. Timing: CUPTI device time (jax's mosaic profiler), median of
--iterations after warm-up.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from pallas_rs.kernel import fused
from pallas_rs import reference
from pallas_rs.bench import shapes as shapes_lib
from pallas_rs.bench import testing

import bench_env  # pylint: disable=g-bad-import-order  (experiments/, sys.path[0] as a script)
import flag_checks  # pylint: disable=g-bad-import-order

_WHAT = flags.DEFINE_enum("what", "correct", ["correct", "perf", "stress"], "Which check.")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")
_ITERS = flags.DEFINE_integer("iterations", 50, "Timed iterations per measurement.")
_STRESS_CALLS = flags.DEFINE_integer("stress_calls", 1000, "Back-to-back calls for --what=stress.")
_SHAPE_FILTER = flags.DEFINE_string("names", "", "Comma-separated seed case names (perf).")

PAIRS = shapes_lib.SEED_NK_PAIRS


_xla_loopback = jax.jit(reference.loopback_matmul_reduce_scatter)


def check(d, m, n, k, seed, config=None):
  xs, ws = testing.stacked_inputs(jax.random.key(seed), d, m, k // d, n)
  ref = testing.stacked_reference(xs, ws)
  if d == 1:
    out = jax.jit(lambda a, b: fused.local_matmul(a, b, config=config))(xs[0], ws[0])[None]
    base = reference.dot(xs[0], ws[0])[None]
  else:
    out = jax.jit(lambda a, b: fused.loopback_matmul_reduce_scatter(a, b, config=config))(xs, ws)
    base = _xla_loopback(xs, ws)
  out = jax.block_until_ready(out)
  e_f, e_x = reference.max_rel_error(out, ref), reference.max_rel_error(base, ref)
  nan = bool(np.isnan(np.asarray(out.astype(jnp.float32))).any())
  return dict(d=d, m=m, n=n, k=k, err_fused=e_f, err_xla=e_x, ratio=e_f / e_x, nan=nan,
              ok=(not nan) and bench_env.rule_holds(e_f, e_x))


def run_correct():
  rows = []
  cases = []
  for d in (1, 2, 4, 8):
    for n, k in PAIRS:
      cases.append((d, 64 * d * 2 if d > 1 else 256, n // 8, k // 4))
  cases += [(8, 512, 8192, 8192), (8, 2048, 6144, 16384), (1, 512, 8192, 1024)]
  for i, (d, m, n, k) in enumerate(cases):
    t = time.time()
    try:
      r = check(d, m, n, k, seed=i)
    except Exception as e:  # Reported per case so one failure does not hide the rest.
      r = dict(d=d, m=m, n=n, k=k, ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    r["seconds"] = round(time.time() - t, 1)
    rows.append(r)
    print(json.dumps(r), flush=True)
  # NaN propagation: a NaN in one rank's x shows up where the reference has it.
  xs, ws = testing.stacked_inputs(jax.random.key(99), 4, 512, 256, 512)
  xs = xs.at[1, 130, 7].set(jnp.nan)
  out = np.asarray(fused.loopback_matmul_reduce_scatter(xs, ws).astype(jnp.float32))
  ref = testing.stacked_reference(xs, ws)
  rows.append(dict(check="nan", ok=bool(np.array_equal(np.isnan(out), np.isnan(ref)))))
  print(json.dumps(rows[-1]), flush=True)
  return rows


def _time(f, *args):
  """Per-iteration device times (us) of `f(*args)`: pallas_rs.bench.timing, 2 warm-up calls."""
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  return list(timing.time_function(f, args, iterations=_ITERS.value, warmup=2).times_us)


def _names() -> list[str]:
  return [s for s in _SHAPE_FILTER.value.split(",") if s]


def run_perf():
  rows = []
  names = _names()
  for case in shapes_lib.select(tags=["seed"]):
    if names and case.name not in names:
      continue
    m, n, k_shard, d = case.m, case.n, case.k // case.num_devices, case.num_devices
    x, w = testing.generate(0, m, k_shard, n)
    r = dict(name=case.name, m=m, n=n, k_shard=k_shard)
    xla = jax.jit(reference.dot)
    r["t_xla_dot_us"] = _time(xla, x, w)
    try:
      f = jax.jit(lambda a, b: fused.local_matmul(a, b))
      r["t_fused_d1_us"] = _time(f, x, w)
      r["d1_ratio"] = statistics.median(r["t_xla_dot_us"]) / statistics.median(r["t_fused_d1_us"])
    except Exception as e:
      r["error_d1"] = f"{type(e).__name__}: {str(e)[:300]}"
    # Loopback at D: the whole node's work (D per-device GEMMs) on one GPU.
    xs, ws = testing.stacked_inputs(jax.random.key(1), d, m, k_shard, n)
    r["t_loopback_xla_us"] = _time(_xla_loopback, xs, ws)
    try:
      g = jax.jit(lambda a, b: fused.loopback_matmul_reduce_scatter(a, b))
      r["t_loopback_fused_us"] = _time(g, xs, ws)
    except Exception as e:
      r["error_loopback"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(r)
    med = {kk: round(statistics.median(v), 1) for kk, v in r.items() if kk.startswith("t_")}
    print(case.name, med, round(r.get("d1_ratio", float("nan")), 3), flush=True)
  return rows


@jax.jit
def _errors(out, base, xs, ws):
  """Max relative errors of the fused output and of the unfused baseline vs an f32 reference."""
  ref = testing.device_reference(xs, ws)
  return (reference.max_rel_error_on_device(out, ref),
          reference.max_rel_error_on_device(base, ref))


def run_stress():
  """Back-to-back loopback calls with fresh inputs, alternating two shapes, all checked."""
  shapes = [(8, 512, 1024, 2048), (4, 1024, 768, 1536)]
  fns = {s: jax.jit(lambda a, b: fused.loopback_matmul_reduce_scatter(a, b)) for s in shapes}
  bad, worst, t = 0, 0.0, time.time()
  for i in range(_STRESS_CALLS.value):
    shape = shapes[i % 2]
    d, m, n, k = shape
    xs, ws = testing.stacked_inputs(jax.random.key(1000 + i), d, m, k // d, n)
    out = fns[shape](xs, ws)
    e_f, e_x = (float(e) for e in _errors(out, _xla_loopback(xs, ws), xs, ws))
    worst = bench_env.worse(worst, e_f / e_x)
    if not bench_env.rule_holds(e_f, e_x):
      bad += 1
  return [dict(check="stress", calls=_STRESS_CALLS.value, shapes=shapes, bad=bad,
               worst_ratio=worst, seconds=round(time.time() - t, 1))]


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.subset("names", _names(), [case.name for case in shapes_lib.select(tags=["seed"])])


def failures(what: str, rows: list[dict]) -> tuple[int, int]:
  """(failed, checked) of a correct or stress run: cases not ok (errors included), or stress
  calls over the rule; (0, 0) for perf, which checks nothing."""
  if what == "stress":
    return sum(r["bad"] for r in rows), sum(r["calls"] for r in rows)
  if what == "correct":
    return sum(not r["ok"] for r in rows), len(rows)
  return 0, 0


def main(_):
  check_flags()
  env = bench_env.environment_block(sys.argv)
  rows = {"correct": run_correct, "perf": run_perf, "stress": run_stress}[_WHAT.value]()
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(dict(env=env, what=_WHAT.value, rows=rows), f, indent=1)
  failed, checked = failures(_WHAT.value, rows)
  if checked:
    print(f"{_WHAT.value}: {failed} of {checked} failed", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  app.run(main)
