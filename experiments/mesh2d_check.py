"""The fused op over "tp" on a (dp, tp) = (2, 2) mesh of four GPUs (issue 21).

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/mesh2d_check.py --out=/tmp/mesh2d.json
  (or OUT=/tmp/mg bash experiments/run_multi_gpu.sh mesh2d; < 8 minutes)

Each data-parallel group g (dp = g) holds its own tokens: global x [2 m, K] sharded
P("dp", "tp"), w [K, n] sharded P("tp", None); the output [2 m, n] is each group's row-parallel
product, group by group (sharded P(("dp", "tp"), None)). Per seed shape (pallas_rs.shapes, tag
"seed", at D = tp = 2: k_shard = K / 2), on the same inputs:
  1. correctness: the fused result against an fp32 reference of each group's product
     (pallas_rs.bench.testing.device_reference: max relative error over every element) and against
     the unfused path (jnp.dot + psum_scatter over "tp") on the same mesh: fused <= 1.1x
     unfused, and within (D + 1) bf16 roundings;
  2. bit-identity with the 1-D D = 2 fused result of each group's inputs on a mesh of GPUs 0, 1
     (same config): the other mesh axis must change nothing;
  3. "auto" on the 2-D mesh (the public op): bit-identical to the fused result where the tuning
     table (looked up at D = 2) says fused, to the unfused one elsewhere;
  4. one timing row (pallas_rs.bench.timing, CUPTI): fused on the 2-D mesh (4 GPUs), fused on the 1-D
     D = 2 mesh (2 GPUs), unfused on the 2-D mesh.
JSON (environment block, rows) under --out, a table last; exit code 1 if any check fails.
--lower_only exports the 2-D and 1-D fused programs for CUDA and stops, on 8 host devices on any
machine (no GPU needed, and a machine with fewer than four lowers them too).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
import statistics
import sys
import time

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_env (experiments/)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if os.environ["NCCL_NVLS_ENABLE"] != "0":
  raise SystemExit("NCCL_NVLS_ENABLE must be 0 (NVLink multicast is forbidden here)")

import bench_env  # pylint: disable=g-import-not-at-top,wrong-import-position
import flag_checks  # pylint: disable=g-import-not-at-top,wrong-import-position

# Before jax is imported: without a GPU (the --lower_only path on a CPU machine), force 8 host
# devices; with GPUs, check NCCL_NVLS_ENABLE again.
bench_env.configure_environment("auto")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_rs
from pallas_rs.kernel import fused
from pallas_rs.tuning import gate
from pallas_rs import platform
from pallas_rs import reference
from pallas_rs.bench import alternating
from pallas_rs.bench import shapes
from pallas_rs.bench import testing
from pallas_rs.bench import timing
from pallas_rs import tuning

_OUT = flags.DEFINE_string("out", None, "JSON output path.")
_NAMES = flags.DEFINE_list("names", [], "Seed shape names (default: all 16).")
_ITERS = flags.DEFINE_integer("iterations", 30, "Timed iterations per program.")
_TIMING = flag_checks.TimingFlags(__name__, "the three programs")
_SCALE = flags.DEFINE_integer("scale", 1, "Divide the seed m, n and k by this (CPU tests of the "
                              "script itself).")
_BUDGET = flags.DEFINE_float("time_budget_s", 420.0, "Shapes not started by then are skipped "
                             "(recorded as such), to stay under 8 minutes.")
_LOWER_ONLY = flags.DEFINE_bool("lower_only", False, "Export the programs for CUDA and stop.")
_GPU_KIND = flags.DEFINE_string("gpu_kind", "NVIDIA H200", "--lower_only: lower the configs the "
                                "tuning table gives this GPU kind (what the GPU run would use).")

AXES = ("dp", "tp")
G, D = 2, 2  # data-parallel groups, tensor-parallel devices per group
SPECS_2D = (P("dp", "tp"), P("tp", None), P(("dp", "tp"), None))  # x, w, out
SPECS_1D = (P(None, "tp"), P("tp", None), P("tp", None))
BF16_U = 2.0**-8


def require_gpus() -> None:
  if jax.devices()[0].platform != "gpu" or len(jax.devices()) < G * D:
    raise app.UsageError(f"mesh2d_check.py runs the Mosaic GPU kernel on {G * D} GPUs; have "
                         f"{jax.devices()}; --lower_only needs none")


def make_meshes():
  """(dp, tp) = (2, 2) over devices 0-3, and the 1-D tp = 2 mesh over devices 0, 1 (both
  row-major, as the kernel needs). Auto axes: the fp32 reference is plain jnp on the global
  arrays, partitioned by XLA."""
  devices, auto = jax.devices(), jax.sharding.AxisType.Auto
  return (jax.make_mesh((G, D), AXES, devices=devices[:G * D], axis_types=(auto, auto)),
          jax.make_mesh((D,), ("tp",), devices=devices[:D], axis_types=(auto,)))


def problems():
  cases = shapes.select(tags="seed", names=_NAMES.value or None)
  s = _SCALE.value
  return [(c.name, c.m // s, c.n // s, c.k // s) for c in cases]


def kernel_config(m, n, k_shard):
  """The config "fused" runs for this per-device shape at D = 2 (the tuning table's for the shape
  where there is one, else the default): one config for the 2-D and the 1-D runs. With
  --lower_only, the one the table gives --gpu_kind."""
  gpu_kind = _GPU_KIND.value if _LOWER_ONLY.value else None
  try:
    return gate.decide("matmul_rs", m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16,
                       num_devices=D, implementation="fused", gpu_kind=gpu_kind).config.config
  except NotImplementedError:
    return None  # The kernel says why when it is called (the CPU plumbing test's stand-in runs).


def programs(mesh2, mesh1, config):
  """jit(shard_map) programs on global arrays: fused 2-D, fused 1-D, unfused 2-D, auto 2-D."""
  kernel = functools.partial(fused.fused_matmul_reduce_scatter, axis_name="tp", num_devices=D,
                             config=config)
  unfused = functools.partial(reference.matmul_reduce_scatter, axis_name="tp")
  auto = functools.partial(pallas_rs.matmul_reduce_scatter, axis_name="tp", implementation="auto")

  def smap(body, mesh, specs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs[:2], out_specs=specs[2],
                                 check_vma=False))

  return dict(fused_2d=smap(kernel, mesh2, SPECS_2D), fused_1d=smap(kernel, mesh1, SPECS_1D),
              unfused_2d=smap(unfused, mesh2, SPECS_2D), auto_2d=smap(auto, mesh2, SPECS_2D))


@functools.partial(jax.jit, static_argnums=(4,))
def errors(out, base, x, w, m):
  """Max relative errors of the fused and unfused outputs [G m, n] against an fp32 reference of
  each group's product (group g: rows g m .. (g + 1) m of x)."""
  ref = jnp.concatenate([
      testing.device_reference(*testing.split_inputs(x[g * m:(g + 1) * m], w, D)).reshape(m, -1)
      for g in range(G)])
  return (reference.max_rel_error_on_device(out, ref),
          reference.max_rel_error_on_device(base, ref))


@jax.jit
def _count_differing(a, b):
  return jnp.sum(lax.bitcast_convert_type(a, jnp.uint16) != lax.bitcast_convert_type(b, jnp.uint16))


def differing(a, b) -> int:
  """Number of bf16 elements whose bits differ (b moved onto a's devices first)."""
  return int(_count_differing(a, jax.device_put(b, a.sharding)))


def check_shape(name, m, n, k, seed, mesh2, mesh1) -> dict:
  k_shard = k // D
  config = kernel_config(m, n, k_shard)
  fns = programs(mesh2, mesh1, config)
  row = dict(name=name, m=m, n=n, k=k, k_shard=k_shard, groups=G, d=D,
             config=None if config is None else tuning.config_to_json(config))
  x, w = testing.generate(seed, G * m, k, n, num_devices=D, shardings=tuple(
      NamedSharding(mesh2, s) for s in SPECS_2D[:2]))
  out = fns["fused_2d"](x, w)
  base = fns["unfused_2d"](x, w)
  e_f, e_x = (float(e) for e in errors(out, base, x, w, m))
  row.update(err_fused=e_f, err_unfused=e_x, ratio=e_f / e_x if e_x else None,
             ok_error=bench_env.rule_holds(e_f, e_x) and bool(e_f <= (D + 1) * BF16_U))
  # The same per-group inputs on the 1-D mesh: bit for bit the 2-D result's rows of the group.
  w1 = jax.device_put(w, NamedSharding(mesh1, SPECS_1D[1]))
  x1 = [jax.device_put(x[g * m:(g + 1) * m], NamedSharding(mesh1, SPECS_1D[0])) for g in range(G)]
  diffs = [differing(fns["fused_1d"](x1[g], w1), out[g * m:(g + 1) * m]) for g in range(G)]
  row.update(bits_differing_vs_1d=diffs, bit_identical_1d=not any(diffs))
  # "auto": the shape-level decision (table at D = 2), and its output bits.
  decision = gate.decide("matmul_rs", m=m, k_shard=k_shard, n=n, dtype="bfloat16",
                         num_devices=D, gpu_kind=platform.device_kind())
  auto = fns["auto_2d"](x, w)
  expected = out if decision.implementation == "fused" else base
  row.update(auto_expected=decision.implementation, auto_reason=decision.reason,
             auto_bits_differing=differing(auto, expected))
  row["ok_auto"] = row["auto_bits_differing"] == 0
  row["ok"] = row["ok_error"] and row["bit_identical_1d"] and row["ok_auto"]
  # Timing (CUPTI on GPU; host wall clock elsewhere: plumbing only).
  # In alternating rounds (a slow phase of the GPUs falls on all alike: BUILD_NOTES,
  # seventy-seventh session).
  programs_timed = {"fused_2d": ((x, w), G * D), "fused_1d": ((x1[0], w1), D),
                    "unfused_2d": ((x, w), G * D)}
  timings = alternating.time_alternating(
      {key: (timing.compile_function(fns[key], args)[0], args, ndev)
       for key, (args, ndev) in programs_timed.items()},
      iterations=_ITERS.value, warmup=2, **_TIMING.kwargs(_ITERS.value))
  for key, t in timings.items():
    row[f"t_{key}_us"] = statistics.median(t.times_us)
    row.setdefault("timings", {})[key] = dataclasses.asdict(t)
  row["timer"] = row["timings"]["fused_2d"]["timer"]
  row["fused_2d_over_1d"] = row["t_fused_2d_us"] / row["t_fused_1d_us"]
  return row


def lower_shape(name, m, n, k, mesh2, mesh1) -> dict:
  """Exports the fused programs of one shape for CUDA (what --lower_only checks)."""
  config = kernel_config(m, n, k // D)
  fns = programs(mesh2, mesh1, config)
  row = dict(name=name, m=m, n=n, k=k, k_shard=k // D,
             config=None if config is None else tuning.config_to_json(config))
  for key, mesh, specs, rows in (("fused_2d", mesh2, SPECS_2D, G * m),
                                 ("fused_1d", mesh1, SPECS_1D, m)):
    avals = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=NamedSharding(mesh, specs[0])),
             jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, specs[1])))
    exported = jax.export.export(fns[key], platforms=["cuda"])(*avals)
    row[f"lowered_{key}"] = "mosaic_gpu" in exported.mlir_module()
  row["ok"] = row["lowered_fused_2d"] and row["lowered_fused_1d"]
  return row


def table(rows) -> str:
  fmt = bench_env.fmt
  lines = [f"{'shape':34} {'ok':>3} {'err/unf':>7} {'bits=1D':>7} {'auto':>5} "
           f"{'fused 2D us':>11} {'fused 1D us':>11} {'2D/1D':>6} {'unfused 2D us':>13}"]
  for r in rows:
    if "error" in r or "skipped" in r:
      lines.append(f"{r['name']:34} {'no':>3}  {r.get('error') or r.get('skipped')}"[:160])
      continue
    if "lowered_fused_2d" in r:
      lines.append(f"{r['name']:34} {'yes' if r['ok'] else 'no':>3}  lowered for CUDA (2-D, 1-D)")
      continue
    lines.append(
        f"{r['name']:34} {'yes' if r['ok'] else 'no':>3} {fmt(r['ratio'], '.3f'):>7} "
        f"{'yes' if r['bit_identical_1d'] else 'no':>7} {r['auto_expected']:>5} "
        f"{fmt(r['t_fused_2d_us'], '.1f'):>11} {fmt(r['t_fused_1d_us'], '.1f'):>11} "
        f"{fmt(r['fused_2d_over_1d'], '.3f'):>6} {fmt(r['t_unfused_2d_us'], '.1f'):>13}")
  return "\n".join(lines)


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.shape_names("names", _NAMES.value)
  _TIMING.check()


def main(argv):
  del argv
  check_flags()
  if _LOWER_ONLY.value:
    bench_env.use_host_devices()  # configure_environment forces them only where no GPU is
  else:
    require_gpus()
  mesh2, mesh1 = make_meshes()
  record = dict(environment=bench_env.environment_block(sys.argv), mesh={"dp": G, "tp": D},
                lower_only=_LOWER_ONLY.value, rows=[])
  start = time.time()
  for i, (name, m, n, k) in enumerate(problems()):
    t = time.time()
    if t - start > _BUDGET.value:
      record["rows"].append(dict(name=name, ok=False, skipped=f"time budget {_BUDGET.value} s"))
      continue
    try:
      if _LOWER_ONLY.value:
        row = lower_shape(name, m, n, k, mesh2, mesh1)
      else:
        row = check_shape(name, m, n, k, seed=i, mesh2=mesh2, mesh1=mesh1)
    except Exception as e:  # Recorded per shape: one failure must not hide the others.
      row = dict(name=name, m=m, n=n, k=k, ok=False, error=f"{type(e).__name__}: {e}"[:600])
    row["seconds"] = round(time.time() - t, 1)
    record["rows"].append(row)
    failed = [key for key in ("ok_error", "bit_identical_1d", "ok_auto") if row.get(key) is False]
    print(name, "ok" if row["ok"] else f"FAILED {row.get('error') or failed}"[:300], flush=True)
    if _OUT.value:  # After every shape: a run cut short by its timeout keeps what it measured.
      bench_env.write_json(Path(_OUT.value), bench_env.sanitize(record))
  print()
  print(table(record["rows"]))
  return 0 if all(r["ok"] for r in record["rows"]) else 1


if __name__ == "__main__":
  app.run(main)
