"""Numerics of the fused reduce vs the unfused path (issue 12): the rule's ratio as a distribution.

The seed's rule: max_rel_error(fused) <= 1.1 * max_rel_error(unfused) against an fp32 reference
(pallas_rs/numerics.py explains both paths' arithmetic). This script measures the distribution of
the ratio over many inputs per case (mode, D, input family, partial_dtype):

  --mode=emulate    CPU only: the numpy bit-exact emulations of both reduces (pallas_rs.numerics)
                    from fp32 partials computed with numpy; reference = float64 sum of the partials.
  --mode=loopback   one GPU: pallas_rs.fused.loopback_matmul_reduce_scatter (D virtual ranks) vs
                    pallas_rs.reference.loopback_matmul_reduce_scatter (the bf16-faithful XLA
                    emulation of the unfused path, source order; rows also give the ratio
                    against the same emulation in NCCL's ring order), fp32 HIGHEST reference.
  --mode=multi_gpu  D = visible GPUs (largest power of two <= 8), under jax.shard_map: fused
                    vs the real unfused path (jnp.dot then a bf16 lax.psum_scatter over NCCL).
  --what=baseline   (GPU modes) what the unfused path computes: bit-compares XLA's real
                    psum_scatter output (and the loopback XLA emulation) with the numpy
                    emulation under each add order and accumulation, checks that the fused
                    kernel's output matches the emulation of its partial_dtype, and saves the
                    optimized HLO of the unfused program next to --out.

Inputs are generated on device from jax.random (input i of a case: numerics.family_inputs(
jax.random.fold_in(jax.random.key(--seed), i), family, m=m, k=k_shard*D, n=n)); the inputs of a
case are one lax.map inside one jit (compiled once per D, all partial dtypes in the same loop on
the same inputs), and only per-input error numbers come back.

GPU (one command, all parts, the baseline first; expected 1-3 min on 2 x H200, --num_inputs
shrinks it; --time_budget_s skips, and records as skipped, sweep cases started after that time):
  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/numerics.py \
      --mode=loopback,multi_gpu --what=baseline,sweep --time_budget_s=200 \
      --out=experiments/results/$(date +%F)_h200x2_numerics.json
The exit code is 1 if any case failed to run (not if a ratio exceeds 1.1: that is the finding).
CPU:
  PYTHONPATH=. python experiments/numerics.py --mode=emulate --num_inputs=200 --shape=128,256,256
"""
from __future__ import annotations

import datetime
import functools
import inspect
import os
from pathlib import Path
import sys
import time
import traceback

from absl import app
from absl import flags
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # pylint: disable=g-import-not-at-top,wrong-import-position

from pallas_rs import numerics  # pylint: disable=g-import-not-at-top,wrong-import-position

MODES = ("emulate", "loopback", "multi_gpu")
WHATS = ("sweep", "baseline")
AXIS = "tp"

_MODE = flags.DEFINE_list("mode", ["emulate"], f"Comma list of {MODES}.")
_WHAT = flags.DEFINE_list("what", ["sweep"], f"Comma list of {WHATS} (baseline: GPU modes).")
_DS = flags.DEFINE_list("num_devices", ["2", "4", "8"],
                        "D values for emulate and loopback (multi_gpu uses the visible GPUs).")
_MULTI_D = flags.DEFINE_integer("multi_gpu_devices", 0,
                                "D of multi_gpu mode; 0: largest power of two <= visible devices.")
_FAMILIES = flags.DEFINE_list("families", list(numerics.FAMILIES), "Input families.")
_NUM = flags.DEFINE_integer("num_inputs", 1000, "Inputs per case.")
_PDS = flags.DEFINE_list("partial_dtypes", list(numerics.PARTIAL_DTYPES),
                         "Config.partial_dtype values of the fused path.")
_SHAPE = flags.DEFINE_list("shape", ["256", "512", "512"],
                           "chunk_m,n,k_shard: each rank's output chunk is chunk_m x n (global "
                           "m = chunk_m * D), each rank's contraction slice k_shard.")
_SEED = flags.DEFINE_integer("seed", 0, "Base seed: input i is fold_in(key(seed), i).")
_BASELINE_INPUTS = flags.DEFINE_integer("baseline_inputs", 4, "Inputs per --what=baseline check.")
_BUDGET = flags.DEFINE_float("time_budget_s", 0.0,
                             "Skip (and record as skipped) cases started after this many seconds; "
                             "0: no limit.")
_OUT = flags.DEFINE_string("out", None, "JSON path (default experiments/out/"
                           "<date>_numerics_<modes>.json, git-ignored); HLO dumps go next to it.")


# ---------------------------------------------------------------------------
# Shapes, configs and the case table.
# ---------------------------------------------------------------------------


def problem(d: int) -> dict:
  chunk, n, ks = (int(v) for v in _SHAPE.value)
  return dict(m=chunk * d, n=n, k_shard=ks, k=ks * d, chunk=chunk)


def make_config(d: int, pd: str):
  """default_config for the loopback / multi_gpu problem, sending partial_dtype=pd
  (`config.with_partial_dtype` narrows the epilogue and the pipeline to fit SMEM)."""
  from pallas_rs import config as config_lib  # pylint: disable=g-import-not-at-top
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  p = problem(d)
  sms = fused.gpu_num_sms() or config_lib.DEFAULT_NUM_SMS
  base = config_lib.default_config(m=p["m"], n=p["n"], k_shard=p["k_shard"], num_devices=d,
                                   num_sms=sms)
  cfg = config_lib.with_partial_dtype(base, pd, d)
  cfg.check_shape(m=p["m"], n=p["n"], k_shard=p["k_shard"], num_devices=d)
  return cfg


def kernel_reads_partial_dtype() -> bool:
  """Whether kernel.py / fused.py mention partial_dtype at all (False: the field is ignored)."""
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import kernel  # pylint: disable=g-import-not-at-top
  return any("partial_dtype" in inspect.getsource(mod) for mod in (kernel, fused))


class Budget:
  def __init__(self, seconds: float):
    self.t0, self.seconds = time.time(), seconds

  def exceeded(self) -> bool:
    return self.seconds > 0 and time.time() - self.t0 > self.seconds


def _case_rows(mode, d, family, pds, stats, seeds, *, seconds, extra=None):
  """stats: dict with "err_unfused" [B] and "err_fused_<pd>" [B] (float64); one row per pd."""
  p = problem(d)
  rows = []
  for pd in pds:
    row = dict(mode=mode, d=d, family=family, partial_dtype=pd, shape=p,
               **numerics.ratio_summary(stats[f"err_fused_{pd}"], stats["err_unfused"], seeds),
               seconds=seconds, **(extra or {}))
    rows.append(row)
  if len(pds) > 1:  # Same inputs for every partial dtype: did the knob change anything?
    first = stats[f"err_fused_{pds[0]}"]
    for row in rows:
      row["frac_inputs_error_differs_from_" + pds[0]] = float(
          np.mean(stats[f"err_fused_{row['partial_dtype']}"] != first))
  return rows


def _error_row(mode, d, family, pd, exc, seconds=None):
  return dict(mode=mode, d=d, family=family, partial_dtype=pd, shape=problem(d),
              error=f"{type(exc).__name__}: {exc}"[:1500], seconds=seconds)


# ---------------------------------------------------------------------------
# emulate (CPU, numpy).
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _generator(m, k, n, batch):
  import jax  # pylint: disable=g-import-not-at-top

  def gen(base, seeds, fam):
    key = jax.random.key(base)
    return jax.vmap(lambda s: numerics.family_inputs(jax.random.fold_in(key, s), fam,
                                                     m=m, k=k, n=n))(seeds)
  return jax.jit(gen)


def emulate_case(d, family, pds, num_inputs):
  p = problem(d)
  batch = 8
  gen = _generator(p["m"], p["k"], p["n"], batch)
  fam = numerics.FAMILIES.index(family)
  stats = {"err_unfused": [], "err_unfused_source": [], **{f"err_fused_{pd}": [] for pd in pds}}
  for start in range(0, num_inputs, batch):
    seeds = np.arange(start, start + batch, dtype=np.int32)
    xb, wb = gen(_SEED.value, seeds, fam)
    xb, wb = np.asarray(xb), np.asarray(wb)
    for i in range(min(batch, num_inputs - start)):
      xs, ws = numerics.split_inputs(xb[i], wb[i], d)
      partials, ref = numerics.partials_and_reference(xs, ws)
      errs = numerics.case_errors(partials, ref, partial_dtypes=pds)
      stats["err_unfused"].append(errs["unfused_ring"])
      stats["err_unfused_source"].append(errs["unfused_source"])
      for pd in pds:
        stats[f"err_fused_{pd}"].append(errs[f"fused_{pd}"])
  return {k: np.asarray(v, np.float64) for k, v in stats.items()}


# ---------------------------------------------------------------------------
# loopback and multi_gpu (device).
# ---------------------------------------------------------------------------


def _errors_from_numerators(out: np.ndarray, pds) -> dict:
  """out [B, 2 + P (+ 1)]: max|unfused - ref|, max|ref|, max|fused_pd - ref| per pd, and in
  loopback max|ring-order unfused - ref| (on device)."""
  out = np.asarray(out, np.float64)
  den = out[:, 1]
  safe = np.where(den > 0, den, 1.0)
  stats = {"err_unfused": out[:, 0] / safe}
  for i, pd in enumerate(pds):
    stats[f"err_fused_{pd}"] = out[:, 2 + i] / safe
  if out.shape[1] > 2 + len(pds):
    stats["err_unfused_ring"] = out[:, 2 + len(pds)] / safe
  return stats


def _device_stats(fused_outs, unfused, ref, more_unfused=()):
  """[max|unfused - ref|, max|ref|, max|fused_i - ref| ..., max|more_unfused_j - ref| ...]."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  f32 = jnp.float32
  err = lambda o: jnp.max(jnp.abs(o.astype(f32) - ref))
  return jnp.stack([err(unfused), jnp.max(jnp.abs(ref))] + [err(o) for o in fused_outs]
                   + [err(o) for o in more_unfused])


def _f32_ref(x, w):
  """fp32 reference of bf16 x @ w. reduce_precision keeps the operands' bf16 values even where
  XLA elides a convert pair (excess precision; family_inputs rounds the same way at the source)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  rnd = lambda v: jax.lax.reduce_precision(v.astype(jnp.float32), exponent_bits=8,
                                           mantissa_bits=7)
  return jnp.dot(rnd(x), rnd(w), precision=jax.lax.Precision.HIGHEST)


def loopback_fn(d, cfgs):
  """jit(seeds [B], family index, base seed) -> [B, 2 + len(cfgs)] error numerators."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  p = problem(d)

  def run(seeds, fam, base):
    key = jax.random.key(base)

    def one(seed):
      x, w = numerics.family_inputs(jax.random.fold_in(key, seed), fam, m=p["m"], k=p["k"],
                                    n=p["n"])
      xs, ws = numerics.split_inputs(x, w, d)
      outs = [fused.loopback_matmul_reduce_scatter(xs, ws, config=c) for c in cfgs]
      unfused = reference.loopback_matmul_reduce_scatter(xs, ws)
      ref = _f32_ref(x, w).reshape(d, p["chunk"], p["n"])
      ring = reference.loopback_matmul_reduce_scatter(xs, ws, order="ring")
      return _device_stats(outs, unfused, ref, [ring])
    return lax.map(one, seeds)
  dev = jax.devices()[0]
  return jax.jit(run), lambda a: jax.device_put(a, dev)


def multi_gpu_fn(d, cfgs):
  """Same as loopback_fn on a 1-D mesh of d devices: the fused kernel over NVLink and the real
  unfused path (jnp.dot + bf16 psum_scatter over NCCL); the per-input maxima are pmax-ed."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  p = problem(d)
  mesh = _mesh(d)

  def body(seeds, fam, base):
    key = jax.random.key(base[0])
    r = lax.axis_index(AXIS)

    def one(seed):
      # The global inputs on every device (small), then this device's k-slice.
      x, w = numerics.family_inputs(jax.random.fold_in(key, seed), fam[0], m=p["m"], k=p["k"],
                                    n=p["n"])
      xl = lax.dynamic_slice_in_dim(x, r * p["k_shard"], p["k_shard"], axis=1)
      wl = lax.dynamic_slice_in_dim(w, r * p["k_shard"], p["k_shard"], axis=0)
      outs = [fused.fused_matmul_reduce_scatter(xl, wl, axis_name=AXIS, num_devices=d, config=c)
              for c in cfgs]
      # optimization_barrier keeps the bf16 values at both ends of the collective as a user's
      # program has them (no fusion of the f32 error computation into the reduce-scatter).
      part = lax.optimization_barrier(
          jnp.dot(xl, wl, preferred_element_type=jnp.float32).astype(xl.dtype))
      unfused = lax.optimization_barrier(
          lax.psum_scatter(part, AXIS, scatter_dimension=0, tiled=True))
      ref = lax.dynamic_slice_in_dim(_f32_ref(x, w), r * p["chunk"], p["chunk"], axis=0)
      return lax.pmax(_device_stats(outs, unfused, ref), AXIS), unfused
    return lax.map(one, seeds)

  # The unfused outputs also come back (materialised bf16, as a user's program gets them):
  # unfused_errors_fn recomputes their error in a separate program, and the rows record on how
  # many inputs the in-loop error differed (nonzero: XLA rewrote the unfused arithmetic inside
  # the measuring loop; the separate program's figure is the one used).
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()),
                    out_specs=(P(), P(None, AXIS, None)), check_vma=False)

  def run(seeds, fam, base):
    return f(seeds, jnp.reshape(fam, (1,)), jnp.reshape(base, (1,)))
  replicated = NamedSharding(mesh, P())
  return jax.jit(run), lambda a: jax.device_put(a, replicated)


def _mesh(d: int):
  """1-D mesh over the first d devices, Auto axis type (its arrays move freely to one device)."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.make_mesh((d,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:d])


@functools.lru_cache(maxsize=None)
def unfused_errors_fn(d):
  """jit(unfused [B, m, n] bf16, seeds, family, base) -> [B] max|unfused - ref| on one device."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  p = problem(d)

  def run(unfused, seeds, fam, base):
    key = jax.random.key(base)

    def one(args):
      seed, u = args
      x, w = numerics.family_inputs(jax.random.fold_in(key, seed), fam, m=p["m"], k=p["k"],
                                    n=p["n"])
      return jnp.max(jnp.abs(u.astype(jnp.float32) - _f32_ref(x, w)))
    return lax.map(one, (seeds, unfused))
  return jax.jit(run)


def device_cases(mode, d, families, pds, num_inputs, budget):
  """Rows of every (family, pd) at this D; one compile for all pds, or one per pd on failure.

  The arguments are placed explicitly (one GPU, or replicated over the mesh) so that the
  ahead-of-time compiled executable is called with the shardings it was compiled for.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as onp  # pylint: disable=g-import-not-at-top,reimported
  make = loopback_fn if mode == "loopback" else multi_gpu_fn

  def args(place, fam):
    return (place(onp.arange(num_inputs, dtype=onp.int32)),
            place(onp.int32(numerics.FAMILIES.index(fam))), place(onp.int32(_SEED.value)))

  def build(group_pds):
    fn, place = make(d, [make_config(d, pd) for pd in group_pds])
    return fn.lower(*args(place, families[0])).compile(), place

  groups, rows = [], []
  t = time.time()
  try:
    groups.append((list(pds), *build(pds)))
  except Exception:  # pylint: disable=broad-except
    print(f"[{mode} D={d}] joint compile failed, compiling per partial dtype:\n"
          f"{traceback.format_exc()[-3000:]}", flush=True)
    for pd in pds:
      try:
        groups.append(([pd], *build([pd])))
      except Exception as e:  # pylint: disable=broad-except
        rows += [_error_row(mode, d, fam, pd, e) for fam in families]
  compile_s = round(time.time() - t, 2)
  for fam in families:
    for group_pds, compiled, place in groups:
      if budget.exceeded():
        rows += [dict(_error_row(mode, d, fam, pd, RuntimeError("skipped")), skipped=True)
                 for pd in group_pds]
        continue
      t = time.time()
      try:
        out = compiled(*args(place, fam))
        extra = dict(compile_seconds=compile_s)
        if mode == "multi_gpu":
          out, unfused = out
          dev0 = lambda a: jax.device_put(a, jax.devices()[0])
          num = np.asarray(jax.device_get(unfused_errors_fn(d)(
              dev0(unfused), *(dev0(a) for a in args(lambda a: a, fam)))), np.float64)
          out = np.array(jax.device_get(out), np.float64)
          # Inputs where the in-loop unfused error differs from the materialised output's:
          # nonzero means XLA rewrote the unfused arithmetic inside the measuring loop.
          extra["frac_inputs_unfused_error_rewritten_in_loop"] = float(
              np.mean(num != out[:, 0].astype(np.float32)))
          out[:, 0] = num
        out = jax.device_get(out)
        seconds = round(time.time() - t, 3)
        stats = _errors_from_numerators(out, group_pds)
        new_rows = _case_rows(mode, d, fam, group_pds, stats, np.arange(num_inputs),
                              seconds=seconds, extra=extra)
        if "err_unfused_ring" in stats:  # loopback: the unfused sum in NCCL's ring order too
          for row in new_rows:
            r = numerics.ratio_summary(stats[f"err_fused_{row['partial_dtype']}"],
                                       stats["err_unfused_ring"])
            row["vs_ring_order"] = {k: r[k] for k in ("max", "p99", "median", "num_over_bound",
                                                      "worst_seed")}
        rows += new_rows
      except Exception as e:  # pylint: disable=broad-except
        print(traceback.format_exc()[-3000:], flush=True)
        rows += [_error_row(mode, d, fam, pd, e, round(time.time() - t, 3)) for pd in group_pds]
      print(f"[{mode} D={d} {fam}] {round(time.time() - t, 2)} s (compile {compile_s} s)",
            flush=True)
  return rows


# ---------------------------------------------------------------------------
# --what=baseline: what does the unfused path compute?
# ---------------------------------------------------------------------------


def _bits_equal_fraction(a, b) -> float:
  a = np.asarray(a).astype(numerics.BF16)
  b = np.asarray(b).astype(numerics.BF16)
  return float(np.mean(a.view(np.uint16) == b.view(np.uint16)))


def _emulation_matches(out, partials) -> dict:
  """Fraction of bf16 outputs bit-equal to the numpy unfused emulation, per order/accumulate."""
  res = {}
  for acc in numerics.UNFUSED_ACCUMULATE:
    for order in numerics.UNFUSED_ORDERS:
      emu = numerics.unfused_reduce_scatter(partials, order=order, accumulate=acc)
      res[f"{order}/{acc}"] = _bits_equal_fraction(out, emu)
  return res


def _fused_rows(fused_fs, run, partials):
  """Per partial dtype: how the kernel's output `run(f)` matches each fused emulation, or the
  error that building (an Exception in fused_fs) or running it raised."""
  rows = {}
  for pd, f in fused_fs.items():
    if isinstance(f, Exception):
      rows[pd] = f"{type(f).__name__}: {f}"[:500]
      continue
    try:
      rows[pd] = dict(vs_fused_emulation=_fused_matches(run(f), partials))
    except Exception as e:  # pylint: disable=broad-except
      rows[pd] = f"{type(e).__name__}: {e}"[:500]
  return rows


def _fused_matches(out, partials) -> dict:
  return {pd: _bits_equal_fraction(out, numerics.fused_owner_sum(partials, partial_dtype=pd))
          for pd in numerics.PARTIAL_DTYPES}


def _hlo_lines(text: str) -> list[str]:
  keys = ("reduce-scatter", "all-reduce", "convert", "reduce-precision")
  return [ln.strip()[:400] for ln in text.splitlines()
          if any(k in ln for k in keys[:2]) or ("convert" in ln and "bf16" in ln)][:40]


def _save_hlo(out_dir: Path, stem: str, name: str, compiled) -> dict:
  text = compiled.as_text()
  path = out_dir / f"{stem}_hlo_{name}.txt"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  return dict(hlo_file=str(path), collective_lines=_hlo_lines(text))


def baseline_multi_gpu(d, families, pds, out_path: Path) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  p = problem(d)
  mesh = _mesh(d)
  specs = dict(mesh=mesh, in_specs=(P(None, AXIS), P(AXIS, None)), check_vma=False)

  def user(x, w):  # Exactly what users write (reference.matmul_reduce_scatter).
    return lax.psum_scatter(jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                            AXIS, scatter_dimension=0, tiled=True)

  def with_partials(x, w):  # The same, also returning the fp32 partial that was rounded.
    part = jnp.dot(x, w, preferred_element_type=jnp.float32)
    out = lax.psum_scatter(part.astype(x.dtype), AXIS, scatter_dimension=0, tiled=True)
    return part[None], out

  user_f = jax.jit(jax.shard_map(user, out_specs=P(AXIS, None), **specs))
  parts_f = jax.jit(jax.shard_map(with_partials, out_specs=(P(AXIS, None, None), P(AXIS, None)),
                                  **specs))
  fused_fs = {}
  for pd in pds:
    try:
      cfg = make_config(d, pd)
      fused_fs[pd] = jax.jit(jax.shard_map(
          functools.partial(fused.fused_matmul_reduce_scatter, axis_name=AXIS, num_devices=d,
                            config=cfg), out_specs=P(AXIS, None), **specs))
    except Exception as e:  # pylint: disable=broad-except
      fused_fs[pd] = e
  gen = jax.jit(lambda s, fam: numerics.family_inputs(
      jax.random.fold_in(jax.random.key(_SEED.value), s), fam, m=p["m"], k=p["k"], n=p["n"]),
                static_argnums=1)
  res = dict(d=d, shape=p, inputs=[])
  for fam in families:
    for s in range(_BASELINE_INPUTS.value):
      x, w = gen(s, fam)
      x = jax.device_put(x, NamedSharding(mesh, P(None, AXIS)))
      w = jax.device_put(w, NamedSharding(mesh, P(AXIS, None)))
      if "hlo" not in res:
        stem = out_path.stem
        res["hlo"] = dict(user=_save_hlo(out_path.parent, stem, f"unfused_multi_gpu_d{d}",
                                         user_f.lower(x, w).compile()),
                          with_partials=_save_hlo(out_path.parent, stem,
                                                  f"unfused_with_partials_multi_gpu_d{d}",
                                                  parts_f.lower(x, w).compile()))
      out_user = np.asarray(user_f(x, w)).reshape(d, p["chunk"], p["n"])
      partials, out_parts = parts_f(x, w)
      partials = np.asarray(partials, np.float32)
      out_parts = np.asarray(out_parts).reshape(d, p["chunk"], p["n"])
      row = dict(family=fam, seed=s,
                 user_equals_with_partials=_bits_equal_fraction(out_user, out_parts),
                 user_vs_emulation=_emulation_matches(out_user, partials),
                 with_partials_vs_emulation=_emulation_matches(out_parts, partials))
      row["fused_kernel"] = _fused_rows(
          fused_fs, lambda f: np.asarray(f(x, w)).reshape(d, p["chunk"], p["n"]), partials)
      res["inputs"].append(row)
  res["summary"] = _summarise_matches(res["inputs"])
  res["user_program_bit_exact_with"] = _exact(res["summary"], "user_vs_emulation")
  return res


def _exact(summary: dict, part: str) -> list[str]:
  """The emulations ("order/accumulate") that matched every bit of every input."""
  prefix = f"min_over_inputs.{part}."
  return sorted(k[len(prefix):] for k, v in summary.items() if k.startswith(prefix) and v == 1.0)


def baseline_loopback(ds, families, pds, out_path: Path) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  results = []
  for d in ds:
    p = problem(d)
    res = dict(d=d, shape=p, inputs=[])
    try:
      def parts_and_ref(xs, ws):
        part = jnp.einsum("dmk,dkn->dmn", xs, ws, preferred_element_type=jnp.float32)
        return part, reference.loopback_matmul_reduce_scatter(xs, ws)
      parts_f = jax.jit(parts_and_ref)
      fused_fs = {}
      for pd in pds:
        try:
          fused_fs[pd] = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter,
                                                   config=make_config(d, pd)))
        except Exception as e:  # pylint: disable=broad-except
          fused_fs[pd] = e
      gen = jax.jit(lambda s, fam: numerics.split_inputs(*numerics.family_inputs(
          jax.random.fold_in(jax.random.key(_SEED.value), s), fam, m=p["m"], k=p["k"],
          n=p["n"]), d), static_argnums=1)
      for fam in families:
        for s in range(_BASELINE_INPUTS.value):
          xs, ws = gen(s, fam)
          if "hlo" not in res:
            res["hlo"] = _save_hlo(out_path.parent, out_path.stem, f"unfused_loopback_d{d}",
                                   parts_f.lower(xs, ws).compile())
          partials, out_ref = parts_f(xs, ws)
          partials = np.asarray(partials, np.float32)
          row = dict(family=fam, seed=s,
                     xla_emulation_vs_emulation=_emulation_matches(out_ref, partials))
          row["fused_kernel"] = _fused_rows(fused_fs, lambda f: f(xs, ws), partials)
          res["inputs"].append(row)
      res["summary"] = _summarise_matches(res["inputs"])
      res["xla_emulation_bit_exact_with"] = _exact(res["summary"], "xla_emulation_vs_emulation")
    except Exception as e:  # pylint: disable=broad-except
      print(traceback.format_exc()[-3000:], flush=True)
      res["error"] = f"{type(e).__name__}: {e}"[:1500]
    results.append(res)
  return results


def _flatten(obj, prefix=""):
  if isinstance(obj, dict):
    for k, v in obj.items():
      yield from _flatten(v, f"{prefix}{k}.")
  elif isinstance(obj, float):
    yield prefix[:-1], obj


def _summarise_matches(rows) -> dict:
  """Minimum over inputs of every match fraction (keys flattened with dots)."""
  mins = {}
  for row in rows:
    for k, v in _flatten({k: v for k, v in row.items() if k not in ("family", "seed")}):
      mins[k] = min(mins.get(k, 1.0), v)
  return {f"min_over_inputs.{k}": v for k, v in sorted(mins.items())}


# ---------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------


def default_out(modes) -> Path:
  date = datetime.date.today().isoformat()
  return bench_env.default_out(f"{date}_numerics_{'_'.join(modes)}.json")


def print_table(rows) -> None:
  print("\nmode       D  family          partial    max    p99    median  >1.1/N      worst_seed")
  for r in rows:
    if "error" in r:
      print(f"{r['mode']:<10} {r['d']:<2} {r['family']:<15} {r['partial_dtype']:<9}  "
            f"{'skipped' if r.get('skipped') else 'ERROR: ' + r['error'][:60]}")
      continue
    print(f"{r['mode']:<10} {r['d']:<2} {r['family']:<15} {r['partial_dtype']:<9}  "
          f"{bench_env.fmt(r['max'], '.3f'):<6} {bench_env.fmt(r['p99'], '.3f'):<6} "
          f"{bench_env.fmt(r['median'], '.3f'):<7} "
          f"{r['num_over_bound']:>4}/{r['num_inputs']:<6} {r['worst_seed']}")


def main(argv):
  del argv
  modes = list(_MODE.value)
  whats = list(_WHAT.value)
  if not set(modes) <= set(MODES) or not modes:
    raise app.UsageError(f"--mode={modes} must be a subset of {MODES}")
  if not set(whats) <= set(WHATS) or not whats:
    raise app.UsageError(f"--what={whats} must be a subset of {WHATS}")
  if not set(_FAMILIES.value) <= set(numerics.FAMILIES):
    raise app.UsageError(f"--families={_FAMILIES.value} must be a subset of {numerics.FAMILIES}")
  if not set(_PDS.value) <= set(numerics.PARTIAL_DTYPES):
    raise app.UsageError(f"--partial_dtypes must be a subset of {numerics.PARTIAL_DTYPES}")
  if len(_SHAPE.value) != 3:
    raise app.UsageError(f"--shape={_SHAPE.value} must be chunk_m,n,k_shard")
  if "multi_gpu" in modes:
    bench_env.configure_environment("multi_gpu")  # NCCL_NVLS_ENABLE=0, refuses multicast.
  import jax  # pylint: disable=g-import-not-at-top
  if modes == ["emulate"] and not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")  # The generator only; never grab a GPU.
  out_path = Path(_OUT.value) if _OUT.value else default_out(modes)
  ds = [int(v) for v in _DS.value]
  fams, pds, num = list(_FAMILIES.value), list(_PDS.value), _NUM.value
  budget = Budget(_BUDGET.value)
  result = dict(environment=bench_env.environment_block(sys.argv),
                flags=dict(mode=modes, what=whats, num_devices=ds, families=fams,
                           partial_dtypes=pds, num_inputs=num, shape=_SHAPE.value,
                           seed=_SEED.value, time_budget_s=_BUDGET.value),
                input_recipe=("numerics.family_inputs(jax.random.fold_in(jax.random.key(seed), "
                              "worst_seed), family, m=shape.m, k=shape.k, n=shape.n), split "
                              "along k by numerics.split_inputs"),
                rule_bound=numerics.RULE_BOUND, cases=[], baseline={})
  if set(modes) - {"emulate"}:
    result["kernel_reads_partial_dtype"] = kernel_reads_partial_dtype()
  save = lambda: bench_env.write_json(out_path, bench_env.sanitize(result), allow_nan=False)
  t_start = time.time()

  multi_d = _MULTI_D.value
  if "multi_gpu" in modes and not multi_d:
    n_dev = len(jax.devices())
    multi_d = max((v for v in (2, 4, 8) if v <= n_dev), default=0)
  # The baseline first: it is short and settles what the unfused path computes.
  if "baseline" in whats:
    if "multi_gpu" in modes and multi_d >= 2:
      try:
        result["baseline"]["multi_gpu"] = baseline_multi_gpu(multi_d, fams, pds, out_path)
      except Exception as e:  # pylint: disable=broad-except
        print(traceback.format_exc()[-3000:], flush=True)
        result["baseline"]["multi_gpu"] = dict(error=f"{type(e).__name__}: {e}"[:1500])
      save()
    if "loopback" in modes:
      result["baseline"]["loopback"] = baseline_loopback(ds, fams, pds, out_path)
      save()
  if "sweep" in whats:
    for mode in modes:
      mode_ds = ds if mode != "multi_gpu" else [multi_d]
      for d in mode_ds:
        if mode == "multi_gpu" and d < 2:
          result["cases"] += [_error_row(mode, d, fam, pd, RuntimeError(
              "multi_gpu needs >= 2 visible devices")) for fam in fams for pd in pds]
          continue
        if mode == "emulate":
          for fam in fams:
            if budget.exceeded():
              result["cases"] += [dict(_error_row(mode, d, fam, pd, RuntimeError("skipped")),
                                       skipped=True) for pd in pds]
              continue
            t = time.time()
            stats = emulate_case(d, fam, pds, num)
            rows = _case_rows(mode, d, fam, pds, stats, np.arange(num),
                              seconds=round(time.time() - t, 2))
            src = numerics.ratio_summary
            for row in rows:  # The same fused outputs against the source-order unfused sum.
              s = src(stats[f"err_fused_{row['partial_dtype']}"], stats["err_unfused_source"])
              row["vs_source_order"] = {k: s[k] for k in ("max", "p99", "median",
                                                          "num_over_bound", "worst_seed")}
            result["cases"] += rows
            print(f"[emulate D={d} {fam}] {rows[0]['seconds']} s", flush=True)
        else:
          result["cases"] += device_cases(mode, d, fams, pds, num, budget)
        save()
  result["total_seconds"] = round(time.time() - t_start, 1)
  save()
  for part, res in result["baseline"].items():
    for r in res if isinstance(res, list) else [res]:
      exact = r.get("user_program_bit_exact_with", r.get("xla_emulation_bit_exact_with"))
      print(f"\nbaseline {part} D={r.get('d')}: {r.get('error') or ''} bit-exact with the "
            f"emulation(s) {exact}")
      for k, v in (r.get("summary") or {}).items():
        print(f"  {k}: {v:.4f}")
  print_table(result["cases"])
  print(f"\n{out_path}  ({result['total_seconds']} s)")
  bad = [r for r in result["cases"] if "error" in r and not r.get("skipped")]
  return 1 if bad else 0


if __name__ == "__main__":
  app.run(main)
