"""Steps back to back in one call, as a training step runs them: per-step time and the SM clock.

  PYTHONPATH=. python experiments/sustained_load.py --steps=4,128,512,4
  PYTHONPATH=. python experiments/sustained_load.py --tags=seed --steps=4,200ms,200ms
  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/sustained_load.py --devices=2 \
      --tags=proxy8 --steps=4,200ms,200ms

One step run --steps times inside one jitted call, for XLA and pallas_rs's kernel. At D = 1
(--devices=1) a step is the GEMM x [m, k] @ w [k, n]: XLA's dot (`reference.dot`, the unfused
path's GEMM) against `fused.local_matmul`.
At D >= 2 it is a row-parallel layer on the first D GPUs, inside shard_map: each device's
x [m, k] @ w [k, n] reduce-scattered to [m / D, n], `reference.dot` + `psum_scatter` (the
unfused path) against `pallas_rs.matmul_reduce_scatter(implementation="fused")`. The kernel runs the
tuning table's config for the shape (of --table_gpu_kind's entries), else the default. Shapes:
--m/--k/--n, or each --names/--tags shape's per-device problem (m, its k_shard, n: the table's
keys at D = 1; at D = 2 a seed shape's is its proxy8 shape). A --steps entry is N steps or
"Nms": enough steps for a call of at least about N ms by the GEMM's roofline estimate.

Each call is timed with CUPTI (`pallas_rs.bench.timing.time_function`, --iterations calls) while
`gpu_clocks` samples the SM clock (a step's time leaves out the loop counter's own kernel,
`loop_kernels_us`); the two functions take turns, in the other order at every other --steps
entry, so that neither always runs on the warmer GPU. The question (BUILD_NOTES, eighty-fourth
to eighty-seventh sessions): how much do long runs slow down under the power cap, and does the
kernel's lead over XLA at the boost clock hold there? JSON under --out (written after every
case); a table last.
"""
from __future__ import annotations

import math
from pathlib import Path
import statistics
import sys

import bench_env  # experiments/ is sys.path[0] when run as a script.
import config_variants
import flag_checks
import gpu_clocks

from absl import app
from absl import flags

FUNCTIONS = ("xla", "kernel")
AXIS = "tp"
_M = flags.DEFINE_integer("m", 8192, "Rows of x (without --names/--tags).")
_K = flags.DEFINE_integer("k", 8192, "Per-device columns of x, rows of w (without "
                          "--names/--tags).")
_N = flags.DEFINE_integer("n", 8192, "Columns of w (without --names/--tags).")
_NAMES = flags.DEFINE_list("names", [], "Shapes of pallas_rs/bench/shapes.py: each runs its "
                           "per-device problem [m, k_shard] x [k_shard, n].")
_TAGS = flags.DEFINE_list("tags", [], "Shape tags (e.g. seed; all must match); with --names, "
                          "the named shapes that carry them (as matmul_rs_bench and autotune).")
_DEVICES = flags.DEFINE_integer("devices", 1, "D: 1 (a GEMM) or the GPUs of a row-parallel "
                                "layer (GEMM + reduce-scatter).")
_STEPS = flags.DEFINE_list("steps", ["4", "128", "512", "4"],
                           "Per call, N steps or Nms (a call of >= about N ms by the roofline "
                           "estimate); one case per entry and function, in this order.")
_FUNCTIONS = flags.DEFINE_list("functions", list(FUNCTIONS), f"Of {FUNCTIONS}.")
_ITERS = flags.DEFINE_integer("iterations", 3, "Timed calls per case (one CUPTI session).")
_TABLE_GPU_KIND = flags.DEFINE_string(
    "table_gpu_kind", "", "Take the kernel's configs and auto's decisions from the tuning "
    "table's entries of this GPU kind (e.g. 'NVIDIA H200' on an H100); default this GPU's.")
_OUT = flags.DEFINE_string("out", "", "JSON path; default experiments/out/sustained_load.json.")


def check_flags() -> None:
  """UsageError for a bad value, before jax starts."""
  bad = [s for s in _STEPS.value if parse_step(s) is None]
  if bad:
    raise app.UsageError(f"--steps: not N or Nms with N a positive integer: "
                         f"{', '.join(map(repr, bad))}")
  for flag in (_ITERS, _M, _K, _N, _DEVICES):
    flag_checks.positive_ints(flag.name, [flag.value])
  flag_checks.subset("functions", _FUNCTIONS.value, FUNCTIONS)
  flag_checks.shape_names("names", _NAMES.value)
  flag_checks.shape_tags("tags", _TAGS.value)
  bad = [name for name, m, *_ in problems() if m % _DEVICES.value]
  if bad:
    raise app.UsageError(f"--devices={_DEVICES.value} does not divide m of: "
                         f"{', '.join(map(repr, bad))}")


def parse_step(step: str) -> tuple[int, str] | None:
  """"128" -> (128, "steps"); "300ms" -> (300, "ms"); None for anything else."""
  digits, unit = (step[:-2], "ms") if step.endswith("ms") else (step, "steps")
  return (int(digits), unit) if digits.isdigit() and int(digits) > 0 else None


def steps_per_call(step: str, m: int, k: int, n: int) -> int:
  """The steps one call runs for a --steps entry: N, or enough for N ms of the GEMM at its
  roofline estimate (`metrics.estimate_t_gemm`: real steps run longer, so the call does too)."""
  from pallas_rs.tuning import metrics  # pylint: disable=g-import-not-at-top
  count, unit = parse_step(step)
  if unit == "steps":
    return count
  return max(1, math.ceil(count * 1e-3 / metrics.estimate_t_gemm(m, k, n)))


def problems() -> list[tuple[str, int, int, int]]:
  """(name, m, k, n) of each per-device problem to run, in the shape table's order: the shapes
  named in --names (all if none) that carry every tag of --tags, or the one --m/--k/--n shape."""
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  if not _NAMES.value and not _TAGS.value:
    return [(f"m{_M.value}_k{_K.value}_n{_N.value}", _M.value, _K.value, _N.value)]
  cases = shapes.select(tags=_TAGS.value, names=_NAMES.value or None)
  if not cases:
    raise app.UsageError(f"no shape has every tag of --tags={','.join(_TAGS.value)} and a "
                         f"name of --names={','.join(_NAMES.value)}")
  return [(c.name, c.m, c.k_shard, c.n) for c in cases]


def table_gpu_kind() -> str:
  """The GPU kind whose tuning-table entries the kernel's configs come from."""
  from pallas_rs import platform  # pylint: disable=g-import-not-at-top
  return _TABLE_GPU_KIND.value or platform.device_kind()


def kernel_config(m: int, k: int, n: int):
  """The kernel's config for this problem at D = --devices: the table's, else the default."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return config_variants.tuned_config(m=m, k_shard=k, n=n, dtype=jnp.bfloat16,
                                      num_devices=_DEVICES.value, gpu_kind=table_gpu_kind())


def auto_runs(m: int, k: int, n: int) -> str:
  """What implementation="auto" runs for this problem at D = --devices by the table."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import gate  # pylint: disable=g-import-not-at-top
  return gate.decide("matmul_rs", m=m, k_shard=k, n=n, dtype=jnp.bfloat16,
                     num_devices=_DEVICES.value, gpu_kind=table_gpu_kind()).implementation


def repeat(op, steps: int):
  """(x, w) -> op(x, w), computed `steps` times one after the other (the last one returned).
  x passes an optimization barrier every step, so XLA cannot hoist the loop-invariant op out
  of the loop (it does without one) and every step reads x and w again."""
  import jax  # pylint: disable=g-import-not-at-top

  def call(x, w):
    def step(_, carry):
      x, _ = carry
      x = jax.lax.optimization_barrier(x)
      return x, op(x, w)
    return jax.lax.fori_loop(1, steps, step, (x, op(x, w)))[1]
  return call


def repeated(function: str, steps: int, config=None, mesh=None):
  """The jitted call of `steps` steps of `function`: at D = 1 (mesh None) on x [m, k] and
  w [k, n]; on a 1-D mesh of D devices on global x [m, D k] and w [D k, n] sharded over AXIS
  (`testing.row_parallel_shardings`), giving [m, n] reduce-scattered over the devices."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import pallas_rs  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  if mesh is None:
    op = (reference.dot if function == "xla"
          else lambda x, w: fused.local_matmul(x, w, config=config))
    return jax.jit(repeat(op, steps))
  if function == "xla":
    op = lambda x, w: reference.matmul_reduce_scatter(x, w, axis_name=AXIS)
  else:
    op = lambda x, w: pallas_rs.matmul_reduce_scatter(x, w, axis_name=AXIS,
                                                      implementation="fused", config=config)
  return jax.jit(jax.shard_map(repeat(op, steps), mesh=mesh, in_specs=(P(None, AXIS), P(AXIS)),
                               out_specs=P(AXIS), check_vma=False))


def run_case(compiled, function: str, step: str, steps: int, args) -> dict:
  """One case: the compiled call warmed up once, then --iterations calls in one CUPTI session
  while the clock is sampled."""
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  compiled(*args).block_until_ready()
  with gpu_clocks.sampled() as clocks:
    got = timing.time_function(compiled, args, iterations=_ITERS.value, warmup=0,
                               num_devices=_DEVICES.value)
  loop_us = loop_kernels_us(got.kernels, steps, _DEVICES.value)
  return {"function": function, "step": step, "steps": steps, "times_us": got.times_us,
          "loop_kernels_us": loop_us,
          "per_step_median_us": statistics.median((t - loop_us) / steps for t in got.times_us),
          "rule": got.rule, "kernels": got.kernels, "notes": got.notes,
          "clocks": clocks.result()}


def loop_kernels_us(kernels: dict | None, steps: int, num_devices: int = 1) -> float:
  """The loop's own kernel time in one call on one device (median launches): the kernels each
  device launched steps - 1 times, its counter's increment (XLA's "loop_add_fusion", ~1 us on
  an H100), where every kernel of the op runs `steps` times (one step comes before the loop).
  `kernels` counts every device's launches (`Timing.kernels`)."""
  return sum(k["count_per_iteration"] / num_devices * k["median_us"]
             for k in (kernels or {}).values()
             if steps > 1 and k["count_per_iteration"] == num_devices * (steps - 1))


def ratio(cases: list[dict], step: str) -> float | None:
  """The kernel's median per-step time over XLA's, over the cases of one --steps entry."""
  per = {f: [c["per_step_median_us"] for c in cases if c["function"] == f and c["step"] == step]
         for f in FUNCTIONS}
  if not (per["xla"] and per["kernel"]):
    return None
  return statistics.median(per["kernel"]) / statistics.median(per["xla"])


def run_problem(name: str, m: int, k: int, n: int, mesh, out: Path, record: dict) -> None:
  """Every --steps entry of one problem, the functions taking turns; the JSON rewritten after
  each case."""
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  d = _DEVICES.value
  config = kernel_config(m, k, n) if "kernel" in _FUNCTIONS.value else None
  problem = {"name": name, "m": m, "k": k, "n": n, "auto_runs": auto_runs(m, k, n),
             "kernel_config": repr(config) if config else None, "compile_s": {}, "cases": []}
  record["problems"].append(problem)
  # x ~ N(0, 1) (device r's scaled by 1 + r / D), w ~ N(0, 1 / (D k)); each device its own.
  args = testing.generate(0, m, d * k, n, num_devices=d, shardings=(
      testing.row_parallel_shardings(mesh, AXIS) if mesh is not None else None))
  compiled = {}
  for i, step in enumerate(_STEPS.value):
    steps = steps_per_call(step, m, k, n)
    for function in _FUNCTIONS.value if i % 2 == 0 else _FUNCTIONS.value[::-1]:
      key = f"{function}_{steps}"
      if key not in compiled:
        compiled[key], problem["compile_s"][key] = timing.compile_function(
            repeated(function, steps, config, mesh), args)
      problem["cases"].append(run_case(compiled[key], function, step, steps, args))
      bench_env.write_json(out, record)
  print(f"{name}: " + ", ".join(
      f"{step} kernel/xla {r:.3f}" for step in dict.fromkeys(_STEPS.value)
      if (r := ratio(problem["cases"], step)) is not None), flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  check_flags()
  d = _DEVICES.value
  bench_env.configure_environment("single_gpu" if d == 1 else "multi_gpu")
  bench_env.require_cupti("sustained_load.py")
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  if len(jax.devices()) < d:
    raise app.UsageError(f"--devices={d}: only {len(jax.devices())} devices here")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:d]), (AXIS,)) if d > 1 else None
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("sustained_load.json")
  record = {"environment": bench_env.environment_block(sys.argv), "devices": d,
            "steps": _STEPS.value, "table_gpu_kind": table_gpu_kind(), "problems": []}
  for name, m, k, n in problems():
    run_problem(name, m, k, n, mesh, out, record)
  print(f"\nwrote {out}\n")
  print(f"| problem (D = {d}) | auto runs | function | step | steps per call "
        "| per step, us (median) | SM MHz (busy median) |")
  print("|---|---|---|---|---|---|---|")
  for problem in record["problems"]:
    for case in problem["cases"]:
      print(f"| {problem['name']} | {problem['auto_runs']} | {case['function']} "
            f"| {case['step']} | {case['steps']} | {case['per_step_median_us']:.1f} "
            f"| {gpu_clocks.busy_mhz(case['clocks'])} |")
  return 0


if __name__ == "__main__":
  app.run(main)
