"""Correctness and stress of the fused path on real GPUs, in one call.

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/multi_gpu_check.py --out=/tmp/mg.json

On >= 2 visible GPUs: the fused path under shard_map (NVLink transport) at D = every power of
two up to the GPU count, against a float64-accurate reference and the unfused path (jnp.dot +
psum_scatter) on the same inputs, on all four seed (n, k) pairs at several m (512 included);
then --stress_calls back-to-back calls with fresh inputs, alternating two shapes, each
followed immediately by an unrelated XLA collective (psum), every output checked. With one
GPU the same checks run through the loopback transport (D virtual ranks), labelled so.
Rule: max relative error <= 1.1x the unfused path's.

A kernel that hangs (a wait that never completes) would stall the call with nothing written:
the JSON is rewritten before every case, naming the one running, and a case (or stress call)
still running after --case_timeout_s dumps every thread's stack to stderr and exits (1).
--variant checks one config family instead of the kernel's choice, e.g.
  python experiments/multi_gpu_check.py --variant=t64x256_wm_noadd --m=2048 --nk=8192x8192
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
from pathlib import Path
import sys
import time

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_env (experiments/)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if os.environ["NCCL_NVLS_ENABLE"] != "0":
  raise SystemExit("NCCL_NVLS_ENABLE must be 0 (NVLink multicast is forbidden here)")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from pallas_rs.kernel import fused
from pallas_rs import reference
from pallas_rs.bench import shapes
from pallas_rs.bench import testing

import bench_env  # pylint: disable=g-import-not-at-top,wrong-import-position  (experiments/)
import config_variants  # pylint: disable=g-import-not-at-top,wrong-import-position  (experiments/)
import flag_checks  # pylint: disable=g-import-not-at-top,wrong-import-position  (experiments/)

_OUT = flags.DEFINE_string("out", None, "JSON output path.")
_STRESS = flags.DEFINE_integer("stress_calls", 1000, "Back-to-back calls in the stress run.")
_MS = flags.DEFINE_list("m", ["512", "2048", "8192"], "Global m values for the correctness run.")
_SCALE = flags.DEFINE_integer("scale", 1, "Divide the seed n and k by this (CPU tests of the "
                              "script itself use small shapes).")
_NK = flags.DEFINE_list("nk", [], "Seed (n, k) pairs to check, as NxK before --scale (e.g. "
                        "8192x8192); empty: all four.")
_VARIANT = flags.DEFINE_string("variant", "", "A config_variants name applied to the kernel's "
                               "default config of each shape (e.g. t64x256_wm_noadd); empty: "
                               "the kernel's own choice.")
_UNVERIFIED = flags.DEFINE_bool("unverified", False, "Let --variant name a config that "
                                "fused.nvlink_unverified refuses over NVLink (it may stall: "
                                "run_multi_gpu.sh stall).")
_CASE_TIMEOUT = flags.DEFINE_integer("case_timeout_s", 300, "A case or stress call running "
                                     "longer is taken for a hang: stacks to stderr, exit 1.")
_AXIS = "tp"
PAIRS = shapes.SEED_NK_PAIRS  # (n, k)


def environment() -> dict:
  """The experiments' environment block (bench_env), plus the NVLink topology."""
  env = bench_env.environment_block(sys.argv)
  env["topo"] = bench_env.run_cmd(["nvidia-smi", "topo", "-m"])
  return env


def case_config(d: int, m: int, n: int, k: int):
  """--variant applied to the kernel's default config for the shape; None without one."""
  if not _VARIANT.value:
    return None
  from pallas_rs.kernel import defaults  # pylint: disable=g-import-not-at-top
  base = defaults.default_config(m=m, n=n, k_shard=k // d, num_devices=d)
  return config_variants.variant_config(base, _VARIANT.value)


@functools.lru_cache(maxsize=None)
def _sharded_fns(d: int, config=None):
  mesh = jax.make_mesh((d,), (_AXIS,), devices=jax.devices()[:d])
  specs = dict(mesh=mesh, in_specs=(P(None, _AXIS), P(_AXIS, None)), out_specs=P(_AXIS, None),
               check_vma=False)
  f = functools.partial(fused.fused_matmul_reduce_scatter, axis_name=_AXIS, num_devices=d,
                        config=config, unverified=_UNVERIFIED.value)
  u = functools.partial(reference.matmul_reduce_scatter, axis_name=_AXIS)

  def fused_then_collective(x, w):  # An unrelated XLA collective right after the kernel.
    out = f(x, w)
    return out, lax.psum(jnp.sum(x.astype(jnp.float32)), _AXIS)

  return (mesh, jax.jit(jax.shard_map(fused_then_collective, **dict(specs, out_specs=(
      P(_AXIS, None), P())))), jax.jit(jax.shard_map(u, **specs)))


@functools.partial(jax.jit, static_argnums=4)
def _errors(out, base, x, w, d):
  """Max relative errors of the fused output and the unfused one ([m, n]) vs an f32 reference."""
  ref = testing.device_reference(*testing.split_inputs(x, w, d)).reshape(out.shape)
  return (reference.max_rel_error_on_device(out, ref),
          reference.max_rel_error_on_device(base, ref))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _loopback_pair(x, w, d, config=None):
  """Fused loopback and the unfused emulation on one GPU, from global x [m, k], w [k, n]; in
  NCCL's ring order for a config in the ring's numerics (which must then match it bit for bit;
  source order, the emulation's default, differs from it at D > 2 by up to ~1.3x in error)."""
  m, n = x.shape[0], w.shape[1]
  xs, ws = testing.split_inputs(x, w, d)
  return (fused.loopback_matmul_reduce_scatter(xs, ws, config=config).reshape(m, n),
          reference.loopback_matmul_reduce_scatter(
              xs, ws, order=testing.unfused_order(config)).reshape(m, n))


def run_one(d, m, n, k, seed, mode):
  """One checked call; a call still running after --case_timeout_s ends the process."""
  faulthandler.dump_traceback_later(_CASE_TIMEOUT.value, exit=True)
  try:
    return _run_one(d, m, n, k, seed, mode)
  finally:
    faulthandler.cancel_dump_traceback_later()


def _run_one(d, m, n, k, seed, mode):
  config = case_config(d, m, n, k)
  if mode == "nvlink":
    mesh, f, u = _sharded_fns(d, config)
    x, w = testing.generate(seed, m, k, n, num_devices=d,
                            shardings=testing.row_parallel_shardings(mesh, _AXIS))
    out, total = f(x, w)
    base = u(x, w)
    if not np.isclose(float(total), float(jnp.sum(x.astype(jnp.float32))), rtol=1e-3):
      raise AssertionError("the XLA collective after the fused kernel gave a wrong sum")
    out, base = jax.device_get(out), jax.device_get(base)
    x, w = jax.device_get(x), jax.device_get(w)
  else:  # One GPU: the same protocol with D virtual ranks.
    x, w = testing.generate(seed, m, k, n, num_devices=d)
    out, base = _loopback_pair(x, w, d, config)
  e_f, e_x = (float(e) for e in _errors(jnp.asarray(out), jnp.asarray(base), jnp.asarray(x),
                                        jnp.asarray(w), d))
  return dict(d=d, m=m, n=n, k=k, mode=mode, err_fused=e_f, err_unfused=e_x,
              ratio=e_f / e_x, ok=bench_env.rule_holds(e_f, e_x))


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.variant_names("variant", [_VARIANT.value] if _VARIANT.value else [])
  flag_checks.positive_ints("m", _MS.value)
  flag_checks.subset("nk", _NK.value, [f"{n}x{k}" for n, k in PAIRS])


def main(_):
  check_flags()
  num_gpus = len(jax.devices())
  mode = "nvlink" if num_gpus >= 2 else "loopback"
  ds = [d for d in (2, 4, 8) if d <= num_gpus] if mode == "nvlink" else [2, 4, 8]
  pairs = [(n, k) for n, k in PAIRS if not _NK.value or f"{n}x{k}" in _NK.value]
  pairs = [(n // _SCALE.value, k // _SCALE.value) for n, k in pairs]
  env = environment() if _OUT.value else None
  rows, stress = [], None

  def write(running=None):
    """The JSON so far, before each case: a run cut short by a hang still names the case."""
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(dict(env=env, variant=_VARIANT.value, correctness=rows, stress=stress,
                       running=running), f, indent=1)

  for d in ds:
    for n, k in pairs:
      for m in map(int, _MS.value):
        t = time.time()
        write(running=dict(d=d, m=m, n=n, k=k, mode=mode))
        try:
          r = run_one(d, m, n, k, seed=len(rows), mode=mode)
        except Exception as e:  # Recorded per case: one failure must not hide the others.
          r = dict(d=d, m=m, n=n, k=k, mode=mode, ok=False, error=f"{type(e).__name__}: {e}"[:500])
        r["seconds"] = round(time.time() - t, 2)
        rows.append(r)
        print(json.dumps(r), flush=True)
  d = ds[-1]
  shapes = [(512, 8192 // _SCALE.value, 8192 // _SCALE.value),
            (2048, 6144 // _SCALE.value, 16384 // _SCALE.value)]
  bad, worst, t = [], 0.0, time.time()
  write(running=dict(check="stress", d=d, mode=mode, calls=_STRESS.value))
  for i in range(_STRESS.value):
    m, n, k = shapes[i % 2]
    r = run_one(d, m, n, k, seed=10_000 + i, mode=mode)
    worst = bench_env.worse(worst, r["ratio"])
    if not r["ok"]:
      bad.append(r)
  stress = dict(check="stress", d=d, mode=mode, calls=_STRESS.value, shapes=shapes,
                failures=len(bad), first_failures=bad[:5], worst_ratio=worst,
                seconds=round(time.time() - t, 1))
  write()
  print(json.dumps(stress), flush=True)
  print(f"\n{mode}: {sum(r['ok'] for r in rows)}/{len(rows)} correctness cases ok; "
        f"stress {stress['calls']} calls at D={d}: {stress['failures']} failures, "
        f"worst error ratio {worst:.3f}")
  return 0 if all(r["ok"] for r in rows) and not bad else 1


if __name__ == "__main__":
  app.run(main)
