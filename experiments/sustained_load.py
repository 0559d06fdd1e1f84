"""GEMMs back to back in one call, as a training step runs them: per GEMM time and the SM clock.

  PYTHONPATH=. python experiments/sustained_load.py --steps=4,128,512,4

One square GEMM x [m, k] @ w [k, k] chained --steps times inside one jitted call (c <- c @ w,
one output, so the call holds one output however long it runs), for XLA's dot and pallas_rs's
kernel at D = 1 (`fused.local_matmul`, the tuning table's config or the default). Each call is
timed with CUPTI (`pallas_rs.bench.timing.time_function`, --iterations calls) while `gpu_clocks`
samples the SM clock. The question (BUILD_NOTES, eighty-fourth session): do long runs slow down
by the clock under the power cap with nothing held, or only where a CUPTI session holds GiB of
outputs? JSON under --out; a table last.
"""
from __future__ import annotations

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
_M = flags.DEFINE_integer("m", 8192, "Rows of x.")
_K = flags.DEFINE_integer("k", 8192, "Columns of x, and w's size (k x k: the chain needs it).")
_STEPS = flags.DEFINE_list("steps", ["4", "128", "512", "4"],
                           "GEMMs per call, one case each, in this order.")
_FUNCTIONS = flags.DEFINE_list("functions", list(FUNCTIONS), f"Of {FUNCTIONS}.")
_ITERS = flags.DEFINE_integer("iterations", 3, "Timed calls per case (one CUPTI session).")
_OUT = flags.DEFINE_string("out", "", "JSON path; default experiments/out/sustained_load.json.")


def check_flags() -> None:
  """UsageError for a bad value, before jax starts."""
  flag_checks.positive_ints("steps", _STEPS.value)
  flag_checks.positive_ints("iterations", [_ITERS.value])
  flag_checks.positive_ints("m", [_M.value])
  flag_checks.positive_ints("k", [_K.value])
  flag_checks.subset("functions", _FUNCTIONS.value, FUNCTIONS)


def kernel_config():
  """The kernel's config for this GEMM at D = 1: the tuning table's, else the default."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return config_variants.tuned_config(m=_M.value, k_shard=_K.value, n=_K.value,
                                      dtype=jnp.bfloat16, num_devices=1)


def chain(function: str, steps: int):
  """The jitted call: `steps` GEMMs c <- c @ w, starting from x."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  if function == "xla":
    gemm = jnp.dot
  else:
    cfg = kernel_config()
    gemm = lambda c, w: fused.local_matmul(c, w, config=cfg)
  return jax.jit(lambda x, w: jax.lax.fori_loop(0, steps, lambda i, c: gemm(c, w), x))


def run_case(function: str, steps: int, args) -> dict:
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  compiled, compile_s = timing.compile_function(chain(function, steps), args)
  compiled(*args).block_until_ready()
  with gpu_clocks.sampled() as clocks:
    got = timing.time_function(compiled, args, iterations=_ITERS.value, warmup=0)
  per_gemm = [t / steps for t in got.times_us]
  return {"function": function, "steps": steps, "times_us": got.times_us,
          "per_gemm_median_us": statistics.median(per_gemm), "rule": got.rule,
          "compile_s": compile_s, "clocks": clocks.result()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  check_flags()
  bench_env.configure_environment("single_gpu")
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  bench_env.require_cupti("sustained_load.py")
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("sustained_load.json")
  record = {"environment": bench_env.environment_block(sys.argv), "m": _M.value, "k": _K.value,
            "kernel_config": repr(kernel_config()) if "kernel" in _FUNCTIONS.value else None,
            "cases": []}
  # x ~ N(0, 1), w ~ N(0, 1 / k): the chain keeps its scale.
  args = testing.generate(0, _M.value, _K.value, _K.value)
  for steps in (int(s) for s in _STEPS.value):
    for function in _FUNCTIONS.value:
      record["cases"].append(run_case(function, steps, args))
      bench_env.write_json(out, record)
  print(f"\nwrote {out}\n")
  print("| function | GEMMs per call | per GEMM, us (median) | SM MHz (busy median) |")
  print("|---|---|---|---|")
  for case in record["cases"]:
    print(f"| {case['function']} | {case['steps']} | {case['per_gemm_median_us']:.1f} "
          f"| {gpu_clocks.busy_mhz(case['clocks'])} |")
  return 0


if __name__ == "__main__":
  app.run(main)
