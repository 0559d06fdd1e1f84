"""GEMMs back to back in one call, as a training step runs them: per GEMM time and the SM clock.

  PYTHONPATH=. python experiments/sustained_load.py --steps=4,128,512,4
  PYTHONPATH=. python experiments/sustained_load.py --tags=seed --steps=4,300ms,300ms

One GEMM x [m, k] @ w [k, n] run --steps times inside one jitted call, for XLA's dot and
pallas_rs's kernel at D = 1 (`fused.local_matmul`, the tuning table's config or the default): the
shape --m/--k/--n, or each shape of --names/--tags as its per-device GEMM [m, k_shard] x
[k_shard, n] (the keys of the D = 1 table entries). A step is "N" GEMMs or "Nms": enough GEMMs
for a call of at least about N ms by the roofline estimate. Each call is timed with CUPTI
(`pallas_rs.bench.timing.time_function`, --iterations calls) while `gpu_clocks` samples the SM
clock; the two functions take turns, in the other order at every other step, so that neither
always runs on the warmer GPU. The question (BUILD_NOTES, eighty-fourth to eighty-seventh
sessions): how much do long runs slow down under the power cap, and does the kernel's lead over
XLA's dot at the boost clock hold there? JSON under --out (written after every case); a table
last.
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
_M = flags.DEFINE_integer("m", 8192, "Rows of x (without --names/--tags).")
_K = flags.DEFINE_integer("k", 8192, "Columns of x, rows of w (without --names/--tags).")
_N = flags.DEFINE_integer("n", 8192, "Columns of w (without --names/--tags).")
_NAMES = flags.DEFINE_list("names", [], "Shapes of pallas_rs/bench/shapes.py: each runs its "
                           "per-device GEMM [m, k_shard] x [k_shard, n] at D = 1.")
_TAGS = flags.DEFINE_list("tags", [], "Shape tags (e.g. seed), added to --names.")
_STEPS = flags.DEFINE_list("steps", ["4", "128", "512", "4"],
                           "Per call, N GEMMs or Nms (a call of >= about N ms by the roofline "
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
  flag_checks.positive_ints("iterations", [_ITERS.value])
  for flag in (_M, _K, _N):
    flag_checks.positive_ints(flag.name, [flag.value])
  flag_checks.subset("functions", _FUNCTIONS.value, FUNCTIONS)
  flag_checks.shape_names("names", _NAMES.value)
  flag_checks.shape_tags("tags", _TAGS.value)


def parse_step(step: str) -> tuple[int, str] | None:
  """"128" -> (128, "gemms"); "300ms" -> (300, "ms"); None for anything else."""
  digits, unit = (step[:-2], "ms") if step.endswith("ms") else (step, "gemms")
  return (int(digits), unit) if digits.isdigit() and int(digits) > 0 else None


def gemms_per_call(step: str, m: int, k: int, n: int) -> int:
  """The GEMMs one call runs for a --steps entry: N, or enough for N ms at the roofline
  estimate (`metrics.estimate_t_gemm`: real GEMMs run longer, so the call does too)."""
  from pallas_rs.tuning import metrics  # pylint: disable=g-import-not-at-top
  count, unit = parse_step(step)
  if unit == "gemms":
    return count
  return max(1, math.ceil(count * 1e-3 / metrics.estimate_t_gemm(m, k, n)))


def gemm_shapes() -> list[tuple[str, int, int, int]]:
  """(name, m, k, n) of each GEMM to run: the named and tagged shapes' per-device GEMMs, or
  the one --m/--k/--n shape."""
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  cases = [shapes.by_name(name) for name in _NAMES.value]
  if _TAGS.value:
    cases += [c for c in shapes.select(_TAGS.value) if c not in cases]
  if not cases:
    return [(f"m{_M.value}_k{_K.value}_n{_N.value}", _M.value, _K.value, _N.value)]
  return [(c.name, c.m, c.k_shard, c.n) for c in cases]


def table_gpu_kind() -> str:
  """The GPU kind whose tuning-table entries the kernel's configs come from."""
  from pallas_rs import platform  # pylint: disable=g-import-not-at-top
  return _TABLE_GPU_KIND.value or platform.device_kind()


def kernel_config(m: int, k: int, n: int):
  """The kernel's config for this GEMM at D = 1: the tuning table's, else the default."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return config_variants.tuned_config(m=m, k_shard=k, n=n, dtype=jnp.bfloat16, num_devices=1,
                                      gpu_kind=table_gpu_kind())


def auto_runs(m: int, k: int, n: int) -> str:
  """What implementation="auto" runs for this GEMM at D = 1 by the table's entries."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import gate  # pylint: disable=g-import-not-at-top
  return gate.decide("matmul_rs", m=m, k_shard=k, n=n, dtype=jnp.bfloat16, num_devices=1,
                     gpu_kind=table_gpu_kind()).implementation


def repeated(function: str, steps: int, config=None):
  """The jitted call: `steps` GEMMs x @ w one after the other, the last one's product returned.
  x passes an optimization barrier every step, so XLA cannot hoist the loop-invariant GEMM
  out of the loop (it does without one) and every step reads x and w again."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  if function == "xla":
    gemm = jnp.dot
  else:
    gemm = lambda x, w: fused.local_matmul(x, w, config=config)

  def call(x, w):
    def step(_, carry):
      x, _ = carry
      x = jax.lax.optimization_barrier(x)
      return x, gemm(x, w)
    y = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
    return jax.lax.fori_loop(0, steps, step, (x, y))[1]
  return jax.jit(call)


def run_case(compiled, function: str, step: str, steps: int, args) -> dict:
  """One case: the compiled call warmed up once, then --iterations calls in one CUPTI session
  while the clock is sampled."""
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  compiled(*args).block_until_ready()
  with gpu_clocks.sampled() as clocks:
    got = timing.time_function(compiled, args, iterations=_ITERS.value, warmup=0)
  per_gemm = [t / steps for t in got.times_us]
  return {"function": function, "step": step, "steps": steps, "times_us": got.times_us,
          "per_gemm_median_us": statistics.median(per_gemm), "rule": got.rule,
          "kernels": got.kernels, "clocks": clocks.result()}


def ratios(cases: list[dict], step: str) -> float | None:
  """The kernel's median per-GEMM time over XLA's, over the cases of one --steps entry."""
  per = {f: [c["per_gemm_median_us"] for c in cases if c["function"] == f and c["step"] == step]
         for f in FUNCTIONS}
  if not (per["xla"] and per["kernel"]):
    return None
  return statistics.median(per["kernel"]) / statistics.median(per["xla"])


def run_shape(name: str, m: int, k: int, n: int, out: Path, record: dict) -> None:
  """Every --steps entry of one GEMM shape, both functions taking turns; the JSON rewritten
  after each case."""
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  config = kernel_config(m, k, n) if "kernel" in _FUNCTIONS.value else None
  shape = {"name": name, "m": m, "k": k, "n": n, "auto_runs": auto_runs(m, k, n),
           "kernel_config": repr(config) if config else None, "compile_s": {}, "cases": []}
  record["shapes"].append(shape)
  # x ~ N(0, 1), w ~ N(0, 1 / k).
  args = testing.generate(0, m, k, n)
  compiled = {}
  for i, step in enumerate(_STEPS.value):
    steps = gemms_per_call(step, m, k, n)
    order = _FUNCTIONS.value if i % 2 == 0 else _FUNCTIONS.value[::-1]
    for function in order:
      key = f"{function}_{steps}"
      if key not in compiled:
        compiled[key], shape["compile_s"][key] = timing.compile_function(
            repeated(function, steps, config), args)
      shape["cases"].append(run_case(compiled[key], function, step, steps, args))
      bench_env.write_json(out, record)
  print(f"{name}: " + ", ".join(
      f"{step} kernel/xla {ratio:.3f}" for step in dict.fromkeys(_STEPS.value)
      if (ratio := ratios(shape["cases"], step)) is not None), flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  check_flags()
  bench_env.configure_environment("single_gpu")
  bench_env.require_cupti("sustained_load.py")
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("sustained_load.json")
  record = {"environment": bench_env.environment_block(sys.argv), "steps": _STEPS.value,
            "table_gpu_kind": table_gpu_kind(), "shapes": []}
  for name, m, k, n in gemm_shapes():
    run_shape(name, m, k, n, out, record)
  print(f"\nwrote {out}\n")
  print("| shape | auto runs | function | step | GEMMs per call | per GEMM, us (median) "
        "| SM MHz (busy median) |")
  print("|---|---|---|---|---|---|---|")
  for shape in record["shapes"]:
    for case in shape["cases"]:
      print(f"| {shape['name']} | {shape['auto_runs']} | {case['function']} | {case['step']} "
            f"| {case['steps']} | {case['per_gemm_median_us']:.1f} "
            f"| {gpu_clocks.busy_mhz(case['clocks'])} |")
  return 0


if __name__ == "__main__":
  app.run(main)
