"""Where the fused kernel's time goes: the kernel with one stage left out at a time.

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/ablate.py --names=llama70b_o_proj_m512

Per seed shape, times (CUPTI device time, median of --iterations) the fused kernel as is and
with `ablate` = "comm" (peer tiles stored locally, no signals or waits), "reduce" (no loads and
adds of received partials), both; plus XLA's dot alone (T_gemm) and dot + psum_scatter (T_seq).
Differences give the exposed cost of each stage (BUILD_NOTES "What to try first"). On several
GPUs this runs the NVLink path over all of them (D = GPU count); on one GPU the loopback at
--num_devices virtual ranks, where "communication" is a local copy. Only the unablated kernel's
output is checked (the ablated ones are wrong by construction).
"""
from __future__ import annotations

import functools
from pathlib import Path
import statistics
import sys

import bench_env  # experiments/ is sys.path[0] when run as a script.

from absl import app
from absl import flags

_NAMES = flags.DEFINE_list("names", ["llama70b_o_proj_m512", "mixtral8x22b_w2_m2048"],
                           "Seed shape names (pallas_rs.shapes).")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Loopback (one GPU): virtual ranks.")
_ITERS = flags.DEFINE_integer("iterations", 100, "Timed iterations per variant.")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/"
                           "ablate_<mode>.json (git-ignored).")

VARIANTS = {"fused": (), "no_comm": ("comm",), "no_reduce": ("reduce",),
            "no_comm_no_reduce": ("comm", "reduce")}


def require_gpu(jax) -> None:
  if jax.devices()[0].platform != "gpu":
    raise app.UsageError("ablate.py times the fused Mosaic GPU kernel: it needs a Hopper GPU")


def main(argv):
  del argv
  mode = bench_env.configure_environment("auto")
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top

  require_gpu(jax)
  gpus = jax.devices()
  nvlink = len(gpus) >= 2
  rows = []
  for name in _NAMES.value:
    case = shapes.by_name(name)
    d = len(gpus) if nvlink else _NUM_DEVICES.value
    m, n, k_shard = case.m, case.n, case.k // d
    row = dict(name=name, d=d, transport="nvlink" if nvlink else "loopback", times_us={})
    if nvlink:
      mesh = jax.make_mesh((d,), ("tp",), devices=gpus[:d])
      specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                   out_specs=P("tp", None), check_vma=False)
      args = testing.generate(0, m, d * k_shard, n, num_devices=d,
                              shardings=testing.row_parallel_shardings(mesh, "tp"))
      ref = testing.stacked_reference(*testing.split_inputs(*args, d))
      build = lambda ablate: jax.jit(jax.shard_map(functools.partial(
          fused.fused_matmul_reduce_scatter, axis_name="tp", num_devices=d, ablate=ablate),
          **specs))
      baselines = {
          "xla_seq": jax.jit(jax.shard_map(functools.partial(
              reference.matmul_reduce_scatter, axis_name="tp"), **specs)),
          "xla_gemm": jax.jit(jax.shard_map(
              lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype),
              **dict(specs, out_specs=P(None, "tp")))),
      }
      check = lambda out: reference.max_rel_error(jax.device_get(out).reshape(d, m // d, n), ref)
    else:
      args = testing.stacked_inputs(0, d, m, k_shard, n)
      ref = testing.stacked_reference(*args)
      build = lambda ablate: jax.jit(functools.partial(
          fused.loopback_matmul_reduce_scatter, ablate=ablate))
      baselines = {"xla_seq": jax.jit(reference.loopback_matmul_reduce_scatter),
                   "xla_gemm": jax.jit(lambda a, b: jnp.einsum(
                       "dmk,dkn->dmn", a, b, preferred_element_type=jnp.float32).astype(a.dtype))}
      check = lambda out: reference.max_rel_error(jax.device_get(out), ref)
    fns = {label: build(ablate) for label, ablate in VARIANTS.items()} | baselines
    for label, fn in fns.items():
      t = timing.time_function(fn, args, iterations=_ITERS.value, num_devices=d if nvlink else 1)
      row["times_us"][label] = t.times_us
      row.setdefault("timer", t.timer)
    row["fused_max_rel_error"] = check(fns["fused"](*args))
    rows.append(row)
    med = {k: statistics.median(v) for k, v in row["times_us"].items()}
    print(name, {k: round(v, 1) for k, v in med.items()}, flush=True)

  print(f"\n{'shape':32} {'D':>2} {'transport':9} " + " ".join(f"{k:>17}" for k in rows[0]["times_us"]))
  for r in rows:
    med = [statistics.median(v) for v in r["times_us"].values()]
    print(f"{r['name']:32} {r['d']:>2} {r['transport']:9} " + " ".join(f"{v:17.1f}" for v in med))
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out(f"ablate_{mode}.json")
  bench_env.write_json(out, bench_env.sanitize(
      dict(environment=bench_env.environment_block(sys.argv), rows=rows)))
  print("wrote", out)


if __name__ == "__main__":
  app.run(main)
