"""How long the NVLink kernel of a config takes to compile, on one GPU (no peers needed).

  PYTHONPATH=. python experiments/compile_probe.py --names=llama70b_o_proj_m2048 \
      --configs=t64x256_wm_noadd,t128x128_wn_noadd,t64x256_wm_tadd
  # with Mosaic GPU's PTX and ptxas output kept:
  MOSAIC_GPU_DUMP_TO=/tmp/dump MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 ... compile_probe.py

The kernel `fused.fused_matmul_reduce_scatter` runs on real devices is built for --num_devices
ranks inside a shard_map over a one-device mesh that stands in for the D-device one (the peers'
ids are computed from the axis index as on D devices; nothing is run) and XLA compiles it. On
one GPU (jax 0.11.2) Mosaic GPU compiles the kernel (PTX, ptxas: the dumps above are written)
and XLA then refuses the program ("NVSHMEM is not supported in XLA": a one-device mesh takes
another path for peer references than the collective metadata of a real D-device mesh), so
the module is the NVLink kernel's up to how a peer's address is formed. Per shape and config
(config_variants names applied to the config "fused" runs for the D-device shape) the wall
time of lowering and of compilation (to XLA's refusal: `compile_error`); a compilation still
running after --timeout_s dumps every thread's stack and exits (1), the JSON naming the case.
Why: the fifth session's NVLink stall hung inside the first call of one config, which the
loopback (a different kernel module) runs fine. With --lower_only (any machine, CPU included)
the module is exported for CUDA instead (jax.export), which is what CI checks.
"""
from __future__ import annotations

import faulthandler
import functools
from pathlib import Path
import sys
import time

import bench_env  # experiments/ is sys.path[0] when run as a script.
from config_variants import tuned_config
from config_variants import variant_config
import flag_checks

from absl import app
from absl import flags

_NAMES = flags.DEFINE_list("names", ["llama70b_o_proj_m2048"], "Seed shape names.")
_CONFIGS = flags.DEFINE_list("configs", ["table"], "config_variants names per shape.")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 2, "D the kernel is built for.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 240, "A compilation running longer: stacks to "
                                "stderr, exit 1.")
_LOWER_ONLY = flags.DEFINE_bool("lower_only", False, "Export for CUDA (jax.export) instead of "
                                "compiling: no GPU needed.")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/"
                           "compile_probe.json (git-ignored).")
_AXIS = "tp"


def probe(name: str, variant: str, d: int, lower_only: bool) -> dict:
  """Lowering and compile (or export) seconds of the D-device kernel of one shape and config."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top

  case = shapes.by_name(name)
  m, n, k_shard = case.m, case.n, case.k // d
  base = tuned_config(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d)
  config = variant_config(base, variant)
  # Checked as for D devices; the one-device mesh is only the stand-in (see the docstring).
  # Nothing runs over NVLink here, so the configs nvlink_unverified refuses compile too.
  checked = fused.CheckedConfig.of(
      fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d,
                            config=config, unverified=True),
      m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d)
  mesh = jax.make_mesh((1,), (_AXIS,), devices=jax.devices()[:1])
  kernel = functools.partial(fused.fused_matmul_reduce_scatter, axis_name=_AXIS,
                             num_devices=d, config=checked)
  fn = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                             check_vma=False))
  x = jax.ShapeDtypeStruct((m, k_shard), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((k_shard, n), jnp.bfloat16)
  row = dict(name=name, config=variant, d=d, m=m, n=n, k_shard=k_shard, config_repr=repr(config))
  t = time.perf_counter()
  if lower_only:
    text = jax.export.export(fn, platforms=["cuda"])(x, w).mlir_module()
    row.update(export_s=round(time.perf_counter() - t, 3), mosaic_gpu="mosaic_gpu" in text)
    return row
  lowered = fn.lower(x, w)
  row["lower_s"] = round(time.perf_counter() - t, 3)
  t = time.perf_counter()
  try:
    lowered.compile()
  except jax.errors.JaxRuntimeError as e:  # XLA's refusal after Mosaic's compile (docstring).
    row["compile_error"] = str(e)[:300]
  row["compile_s"] = round(time.perf_counter() - t, 3)
  return row


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.shape_names("names", _NAMES.value)
  flag_checks.variant_names("configs", _CONFIGS.value)


def main(argv):
  del argv
  bench_env.configure_environment("smoke" if _LOWER_ONLY.value else "auto")
  check_flags()
  import jax  # pylint: disable=g-import-not-at-top
  if not _LOWER_ONLY.value and jax.devices()[0].platform != "gpu":
    raise app.UsageError("compile_probe.py compiles for the GPU it runs on; on a CPU machine "
                         "use --lower_only")
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("compile_probe.json")
  record = dict(env=bench_env.environment_block(sys.argv), rows=[], running=None)
  for name in _NAMES.value:
    for variant in _CONFIGS.value:
      record["running"] = dict(name=name, config=variant)
      bench_env.write_json(out, record)
      faulthandler.dump_traceback_later(_TIMEOUT.value, exit=True)
      try:
        row = probe(name, variant, _NUM_DEVICES.value, _LOWER_ONLY.value)
      except NotImplementedError as e:  # A config the kernel cannot take: recorded, not fatal.
        row = dict(name=name, config=variant, d=_NUM_DEVICES.value, error=str(e)[:400])
      finally:
        faulthandler.cancel_dump_traceback_later()
      record["rows"].append(row)
      print({k: v for k, v in row.items() if k != "config_repr"}, flush=True)
  record["running"] = None
  bench_env.write_json(out, record)
  print(f"\n{'shape':28s} {'config':22s} {'D':>2s} {'lower s':>8s} {'compile s':>10s}")
  for r in record["rows"]:
    print(f"{r['name']:28s} {r['config']:22s} {r['d']:2d} "
          f"{bench_env.fmt(r.get('lower_s', r.get('export_s'))):>8s} "
          f"{bench_env.fmt(r.get('compile_s')):>10s}  "
          f"{(r.get('error') or r.get('compile_error') or '')[:60]}")
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
