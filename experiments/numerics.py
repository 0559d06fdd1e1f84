"""Numerics of the fused reduce vs the unfused path (issues 12, 18): the rule's ratio as a
distribution, per numerics mode.

The seed's rule: max_rel_error(fused) <= 1.1 * max_rel_error(unfused) against an fp32 reference
(pallas_rs/bench/numerics.py explains both paths' arithmetic). This script measures the distribution of
the ratio over many inputs per case (run mode, D, input family, numerics mode), and the share of
output elements bit-identical to the unfused path's:

  --modes           the numerics modes (config.NUMERICS_MODES, built with config.with_numerics):
                    fp32_partials, bf16_partials, unfused_order (default: all three).
  --mode=emulate    CPU only: the numpy bit-exact emulations of both reduces (pallas_rs.bench.numerics)
                    from fp32 partials computed with numpy; reference = float64 sum of the partials;
                    unfused = the emulation in NCCL's ring order (identity ring), with the source
                    order as a second baseline ("vs_source_order").
  --mode=loopback   one GPU: pallas_rs.kernel.fused.loopback_matmul_reduce_scatter (D virtual ranks) vs
                    pallas_rs.reference.loopback_matmul_reduce_scatter (the bf16-faithful XLA
                    emulation of the unfused path) in NCCL's ring order (the source order as a
                    second baseline, "vs_source_order"); fp32 HIGHEST reference.
  --mode=multi_gpu  under jax.shard_map on D = each power of two up to the visible GPUs (2; 2 and 4
                    on four GPUs; --multi_gpu_devices): fused over NVLink vs the real unfused path
                    (jnp.dot then a bf16 lax.psum_scatter over NCCL).
  --what=baseline   (GPU modes) what the unfused path computes: bit-compares XLA's real
                    psum_scatter output (every multi_gpu D: at D = 4 this checks NCCL's real add
                    order against the emulation's ring order) and the loopback XLA emulation with
                    the numpy emulation under each add order and accumulation, checks that the
                    fused kernel's output matches the emulation of its numerics mode, and saves
                    the optimized HLO of the unfused program next to --out.

Inputs are generated on device from jax.random (input i of a case: numerics.family_inputs(
jax.random.fold_in(jax.random.key(--seed), i), family, m=m, k=k_shard*D, n=n)). On device the
inputs of a case are one lax.map inside one jit, compiled once per (run mode, D) with every
numerics mode's kernel in it (once per mode if that fails), the family a traced index; errors
and bit-identity counts are computed on device and only scalars come back: per input and
output max|out - ref| and max|ref| (reference.max_rel_error_on_device's numerator and
denominator, float32), divided on the host in float64 - so that identical outputs get
identical errors however XLA arranges the division in each program - and the count of
elements bit-identical to the unfused output.

The JSON (its file name must contain "numerics") records per case: ratio max / p99 / median /
count over 1.1, the worst input's seed, the share of output elements bit-identical to the
unfused output; and under "rule", per run mode, D and numerics mode, whether the max ratio over
>= numerics.MIN_RULE_INPUTS inputs of each of the four families keeps the rule
(numerics.rule_verdict: true / false / null = not established), with "by_d" combining the GPU
run modes: the input of the tuner and the gate (a measured mode is allowed at D only where it
holds; fp32_partials is guaranteed).

GPU (one command, all parts; ~3-5 min on 2 x H200 (estimate, compiles dominate);
--time_budget_s skips, and records as skipped, cases started after that time; the printed
table comes last):
  NCCL_NVLS_ENABLE=0 PYTHONPATH=. timeout 470 python experiments/numerics.py \
      --mode=multi_gpu,loopback --what=baseline,sweep --time_budget_s=380 \
      --out=experiments/results/$(date +%F)_h200x2_numerics_modes.json
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
import flag_checks  # pylint: disable=g-import-not-at-top,wrong-import-position

from pallas_rs.bench import numerics  # pylint: disable=g-import-not-at-top,wrong-import-position

RUN_MODES = ("emulate", "loopback", "multi_gpu")
DEVICE_RUN_MODES = ("multi_gpu", "loopback")  # The order the sweep runs them in.
WHATS = ("sweep", "baseline")
AXIS = "tp"
SUMMARY_KEYS = ("max", "p99", "median", "num_over_bound", "worst_seed")
# What each run mode's rows compare with: (primary unfused output, second one or None).
UNFUSED_BASELINES = {
    "emulate": ("numerics.unfused_reduce_scatter(order='ring') (NCCL's ring order, identity "
                "ring), from the same fp32 partials",
                "numerics.unfused_reduce_scatter(order='source')"),
    "loopback": ("reference.loopback_matmul_reduce_scatter(order='ring') (XLA, bf16 rounding "
                 "after every add, NCCL's ring order on the identity ring)",
                 "reference.loopback_matmul_reduce_scatter(order='source')"),
    "multi_gpu": ("the real unfused path: reference.dot (XLA's bf16-output GEMM) then "
                  "lax.psum_scatter over NCCL", None),
}

_MODE = flags.DEFINE_list("mode", ["emulate"], f"Run modes: comma list of {RUN_MODES}.")
_WHAT = flags.DEFINE_list("what", ["sweep"], f"Comma list of {WHATS} (baseline: GPU modes).")
_NMODES = flags.DEFINE_list("modes", list(numerics.MODE_NAMES),
                            f"Numerics modes of the fused path ({numerics.MODE_NAMES}).")
_DS = flags.DEFINE_list("num_devices", ["2", "4", "8"],
                        "D values for emulate and loopback (multi_gpu: --multi_gpu_devices).")
_MULTI_D = flags.DEFINE_list("multi_gpu_devices", [],
                             "D values of multi_gpu mode; empty: every power of two from 2 up to "
                             "the visible devices.")
_FAMILIES = flags.DEFINE_list("families", list(numerics.FAMILIES), "Input families.")
_NUM = flags.DEFINE_integer("num_inputs", numerics.MIN_RULE_INPUTS, "Inputs per case.")
_SHAPE = flags.DEFINE_list("shape", ["256", "512", "512"],
                           "chunk_m,n,k_shard: each rank's output chunk is chunk_m x n (global "
                           "m = chunk_m * D), each rank's contraction slice k_shard.")
_SEED = flags.DEFINE_integer("seed", 0, "Base seed: input i is fold_in(key(seed), i).")
_BASELINE_INPUTS = flags.DEFINE_integer("baseline_inputs", 2,
                                        "Inputs per family per --what=baseline check.")
_BUDGET = flags.DEFINE_float("time_budget_s", 0.0,
                             "Skip (and record as skipped) cases started after this many seconds; "
                             "0: no limit.")
_OUT = flags.DEFINE_string("out", None, "JSON path, its name containing 'numerics' (default "
                           "experiments/out/<date>_numerics_<run modes>.json, git-ignored); HLO "
                           "dumps go next to it.")


# ---------------------------------------------------------------------------
# Shapes, configs and the case table.
# ---------------------------------------------------------------------------


def problem(d: int) -> dict:
  chunk, n, ks = (int(v) for v in _SHAPE.value)
  return dict(m=chunk * d, n=n, k_shard=ks, k=ks * d, chunk=chunk)


def make_config(d: int, mode: str):
  """default_config for the loopback / multi_gpu problem in numerics mode `mode`
  (`config.with_numerics` sets partial_dtype and owner_sum, narrows the epilogue and shortens
  the pipeline to fit SMEM)."""
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import defaults  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  p = problem(d)
  sms = fused.gpu_num_sms() or config_lib.DEFAULT_NUM_SMS
  base = defaults.default_config(m=p["m"], n=p["n"], k_shard=p["k_shard"], num_devices=d,
                                 num_sms=sms)
  cfg = config_lib.with_numerics(base, mode, d)
  if not cfg.tma_add:  # Where the mode drops the TMA add, the split NVLink runs without it.
    cfg = config_lib.fit_smem(config_lib.with_wg_along_n(cfg), d)
  cfg.check_shape(m=p["m"], n=p["n"], k_shard=p["k_shard"], num_devices=d)
  assert cfg.numerics == mode, (cfg, mode)
  return cfg


def kernel_reads_numerics() -> dict:
  """Whether the modules that build the kernel (body, comm, epilogue, fused, rank, transport)
  mention each Config numerics field at all (False: the field is ignored and that mode's rows
  measure another mode's arithmetic)."""
  # pylint: disable-next=g-import-not-at-top
  from pallas_rs.kernel import body, comm, epilogue, fused, rank, transport
  src = "".join(inspect.getsource(mod) for mod in (body, comm, epilogue, fused, rank, transport))
  return {field: field in src for field in ("partial_dtype", "owner_sum")}


class Budget:
  def __init__(self, seconds: float):
    self.t0, self.seconds = time.time(), seconds

  def exceeded(self) -> bool:
    return self.seconds > 0 and time.time() - self.t0 > self.seconds


def _mode_fields(md: str) -> dict:
  pd, owner_sum = numerics.NUMERICS_MODES[md]
  return dict(numerics=md, partial_dtype=pd, owner_sum=owner_sum)


def _case_rows(run_mode, d, family, modes, stats, seeds, *, seconds, extra=None):
  """One row per numerics mode. stats (float64 / int arrays over the inputs):
  "err_unfused" [B] (the primary unfused output's error), optionally "err_unfused_alt" [B] (the
  second baseline's), "err_fused_<mode>" [B], "same_<mode>" [B] (elements bit-identical to the
  primary unfused output), optionally "same_alt_<mode>" [B], and "elements" (per input)."""
  p = problem(d)
  total = stats["elements"] * len(seeds)
  rows = []
  for md in modes:
    row = dict(mode=run_mode, d=d, family=family, **_mode_fields(md), shape=p,
               **numerics.ratio_summary(stats[f"err_fused_{md}"], stats["err_unfused"], seeds),
               identical_share=float(np.sum(stats[f"same_{md}"], dtype=np.int64) / total),
               identical_to=UNFUSED_BASELINES[run_mode][0], seconds=seconds, **(extra or {}))
    if "err_unfused_alt" in stats:
      s = numerics.ratio_summary(stats[f"err_fused_{md}"], stats["err_unfused_alt"], seeds)
      row["vs_source_order"] = dict(
          {k: s[k] for k in SUMMARY_KEYS},
          identical_share=float(np.sum(stats[f"same_alt_{md}"], dtype=np.int64) / total))
    rows.append(row)
  if len(modes) > 1:  # Same inputs for every mode: did the knob change anything?
    first = stats[f"err_fused_{modes[0]}"]
    for row in rows:
      row["frac_inputs_error_differs_from_" + modes[0]] = float(
          np.mean(stats[f"err_fused_{row['numerics']}"] != first))
  return rows


def _error_row(run_mode, d, family, md, exc, seconds=None, skipped=False):
  row = dict(mode=run_mode, d=d, family=family, **_mode_fields(md), shape=problem(d),
             error=f"{type(exc).__name__}: {exc}"[:1500], seconds=seconds)
  if skipped:
    row["skipped"] = True
  return row


def _skipped_rows(run_mode, d, families, modes):
  return [_error_row(run_mode, d, fam, md, RuntimeError("skipped (time budget)"), skipped=True)
          for fam in families for md in modes]


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


def _same(a, b) -> int:
  return int(np.sum(np.asarray(a).view(np.uint16) == np.asarray(b).view(np.uint16)))


def emulate_case(d, family, modes, num_inputs):
  p = problem(d)
  batch = 8
  gen = _generator(p["m"], p["k"], p["n"], batch)
  fam = numerics.FAMILIES.index(family)
  stats = {"err_unfused": [], "err_unfused_alt": []}
  for md in modes:
    stats.update({f"err_fused_{md}": [], f"same_{md}": [], f"same_alt_{md}": []})
  for start in range(0, num_inputs, batch):
    seeds = np.arange(start, start + batch, dtype=np.int32)
    xb, wb = gen(_SEED.value, seeds, fam)
    xb, wb = np.asarray(xb), np.asarray(wb)
    for i in range(min(batch, num_inputs - start)):
      xs, ws = numerics.split_inputs(xb[i], wb[i], d)
      partials, ref = numerics.partials_and_reference(xs, ws)
      ring = numerics.unfused_reduce_scatter(partials, order="ring")
      src = numerics.unfused_reduce_scatter(partials, order="source")
      stats["err_unfused"].append(numerics.max_rel_error(ring, ref))
      stats["err_unfused_alt"].append(numerics.max_rel_error(src, ref))
      for md in modes:
        out = numerics.fused_owner_sum(partials, mode=md)
        stats[f"err_fused_{md}"].append(numerics.max_rel_error(out, ref))
        stats[f"same_{md}"].append(_same(out, ring))
        stats[f"same_alt_{md}"].append(_same(out, src))
  stats = {k: np.asarray(v) for k, v in stats.items()}
  stats["elements"] = p["m"] * p["n"]
  return stats


# ---------------------------------------------------------------------------
# loopback and multi_gpu (device).
# ---------------------------------------------------------------------------


def _bits_same(a, b):
  """Number of bit-identical elements of two bf16 arrays (int32 scalar, on device)."""
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  u16 = lambda v: lax.bitcast_convert_type(v.astype(jnp.bfloat16), jnp.uint16)
  return jnp.sum(u16(a) == u16(b), dtype=jnp.int32)


def _abs_max(v):
  """max|v| in float32 (0 for an empty array, inf where v holds a NaN), on device: with
  v = out - ref, the numerator of reference.max_rel_error_on_device; with v = ref, its
  denominator."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  v = v.astype(jnp.float32)
  # A NaN in v gives inf (an unbounded error): a max across devices (the pmax that follows it,
  # or a sharded array's reduction) can drop a NaN (max_rel_error_on_device), not an inf.
  return jnp.where(jnp.any(jnp.isnan(v)), jnp.inf, jnp.max(jnp.abs(v), initial=0.0))


def _rel_host(num, den) -> np.ndarray:
  """max_rel_error from its maxima (arrays), in float64: num / den, 0 where both are 0, inf
  where only den is (reference.max_rel_error's conventions)."""
  num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
  safe = np.where(den > 0, den, 1.0)
  return np.where(den > 0, num / safe, np.where(num > 0, np.inf, 0.0))


def _f32_ref(x, w):
  """fp32 reference of bf16 x @ w. reduce_precision keeps the operands' bf16 values even where
  XLA elides a convert pair (excess precision; family_inputs rounds the same way at the source)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  rnd = lambda v: jax.lax.reduce_precision(v.astype(jnp.float32), exponent_bits=8,
                                           mantissa_bits=7)
  return jnp.dot(rnd(x), rnd(w), precision=jax.lax.Precision.HIGHEST)


def loopback_fn(d, cfgs):
  """jit(seeds [B], family index, base seed) -> (maxima [B, 3 + M] float32: max|out - ref| of
  the ring-order unfused, the source-order unfused and each config's fused output, then
  max|ref|; bit-identical counts [B, 2M] int32: each fused output vs the ring-order unfused,
  then vs the source-order one)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  p = problem(d)

  def run(seeds, fam, base):
    key = jax.random.key(base)

    def one(seed):
      x, w = numerics.family_inputs(jax.random.fold_in(key, seed), fam, m=p["m"], k=p["k"],
                                    n=p["n"])
      xs, ws = numerics.split_inputs(x, w, d)
      outs = [fused.loopback_matmul_reduce_scatter(xs, ws, config=c) for c in cfgs]
      ring = reference.loopback_matmul_reduce_scatter(xs, ws, order="ring")
      src = ring if d == 2 else reference.loopback_matmul_reduce_scatter(xs, ws, order="source")
      ref = _f32_ref(x, w).reshape(d, p["chunk"], p["n"])
      maxima = jnp.stack([_abs_max(o.astype(jnp.float32) - ref) for o in [ring, src] + outs]
                         + [_abs_max(ref)])
      same = jnp.stack([_bits_same(o, u) for u in (ring, src) for o in outs])
      return maxima, same
    return lax.map(one, seeds)
  dev = jax.devices()[0]
  return jax.jit(run), lambda a: jax.device_put(a, dev)


def multi_gpu_fn(d, cfgs):
  """As loopback_fn on a 1-D mesh of d devices: the fused kernel over NVLink and the real
  unfused path (jnp.dot + bf16 psum_scatter over NCCL). -> ((maxima [B, 2 + M], pmax-ed over
  the devices: max|out - ref| of the unfused and each fused output, then max|ref|;
  bit-identical counts [B, M] vs the unfused output, psum-ed), unfused outputs [B, m, n])."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
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
      part = lax.optimization_barrier(reference.dot(xl, wl))
      unfused = lax.optimization_barrier(
          lax.psum_scatter(part, AXIS, scatter_dimension=0, tiled=True))
      ref = lax.dynamic_slice_in_dim(_f32_ref(x, w), r * p["chunk"], p["chunk"], axis=0)
      maxima = lax.pmax(jnp.stack([_abs_max(o.astype(jnp.float32) - ref)
                                   for o in [unfused] + outs] + [_abs_max(ref)]), AXIS)
      same = lax.psum(jnp.stack([_bits_same(o, unfused) for o in outs]), AXIS)
      return (maxima, same), unfused
    return lax.map(one, seeds)

  # The unfused outputs also come back (materialised bf16, as a user's program gets them, kept
  # on the devices): unfused_errors_fn recomputes their error in a separate program, and the rows
  # record on how many inputs the in-loop error differed (nonzero: XLA rewrote the unfused
  # arithmetic inside the measuring loop; the separate program's figure is the one used).
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()),
                    out_specs=((P(), P()), P(None, AXIS, None)), check_vma=False)

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
  """jit(unfused [B, m, n] bf16, seeds, family, base) -> [B, 2]: max|unfused - ref|, max|ref|
  on one device."""
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
      ref = _f32_ref(x, w)
      return jnp.stack([_abs_max(u.astype(jnp.float32) - ref), _abs_max(ref)])
    return lax.map(one, (seeds, unfused))
  return jax.jit(run)


def _device_stats(run_mode, d, modes, maxima, same) -> dict:
  maxima = np.asarray(maxima, np.float64)
  errs = _rel_host(maxima[:, :-1], maxima[:, -1:])
  same = np.asarray(same, np.int64)
  nm_ = len(modes)
  stats = {"err_unfused": errs[:, 0]}
  off = 1
  if run_mode == "loopback":
    stats["err_unfused_alt"] = errs[:, 1]
    off = 2
  for i, md in enumerate(modes):
    stats[f"err_fused_{md}"] = errs[:, off + i]
    stats[f"same_{md}"] = same[:, i]
    if run_mode == "loopback":
      stats[f"same_alt_{md}"] = same[:, nm_ + i]
  p = problem(d)
  stats["elements"] = p["m"] * p["n"]
  return stats


def device_cases(run_mode, d, families, modes, num_inputs, budget):
  """Rows of every (family, mode) at this D; one compile for all modes, or one per mode on
  failure.

  The arguments are placed explicitly (one GPU, or replicated over the mesh) so that the
  ahead-of-time compiled executable is called with the shardings it was compiled for.
  """
  import jax  # pylint: disable=g-import-not-at-top
  make = loopback_fn if run_mode == "loopback" else multi_gpu_fn
  if budget.exceeded():
    return _skipped_rows(run_mode, d, families, modes)

  def args(place, fam):
    return (place(np.arange(num_inputs, dtype=np.int32)),
            place(np.int32(numerics.FAMILIES.index(fam))), place(np.int32(_SEED.value)))

  def build(group):
    fn, place = make(d, [make_config(d, md) for md in group])
    return fn.lower(*args(place, families[0])).compile(), place

  groups, rows = [], []
  t = time.time()
  try:
    groups.append((list(modes), *build(modes)))
  except Exception:  # pylint: disable=broad-except
    print(f"[{run_mode} D={d}] joint compile failed, compiling per numerics mode:\n"
          f"{traceback.format_exc()[-3000:]}", flush=True)
    for md in modes:
      try:
        groups.append(([md], *build([md])))
      except Exception as e:  # pylint: disable=broad-except
        rows += [_error_row(run_mode, d, fam, md, e) for fam in families]
  compile_s = round(time.time() - t, 2)
  for fam in families:
    for group, compiled, place in groups:
      if budget.exceeded():
        rows += _skipped_rows(run_mode, d, [fam], group)
        continue
      t = time.time()
      try:
        out = compiled(*args(place, fam))
        extra = dict(compile_seconds=compile_s)
        if run_mode == "multi_gpu":
          (maxima, same), unfused = out
          dev0 = lambda a: jax.device_put(a, jax.devices()[0])
          sep = np.asarray(jax.device_get(unfused_errors_fn(d)(
              dev0(unfused), *(dev0(a) for a in args(lambda a: a, fam)))), np.float32)
          del unfused
          maxima = np.array(jax.device_get(maxima), np.float32)
          # Inputs where the in-loop unfused error differs from the materialised output's:
          # nonzero means XLA rewrote the unfused arithmetic inside the measuring loop.
          extra["frac_inputs_unfused_error_rewritten_in_loop"] = float(
              np.mean((sep[:, 0] != maxima[:, 0]) | (sep[:, 1] != maxima[:, -1])))
          maxima[:, 0] = sep[:, 0]
        else:
          maxima, same = out
        maxima, same = jax.device_get(maxima), jax.device_get(same)
        seconds = round(time.time() - t, 3)
        stats = _device_stats(run_mode, d, group, maxima, same)
        rows += _case_rows(run_mode, d, fam, group, stats, np.arange(num_inputs),
                           seconds=seconds, extra=extra)
      except Exception as e:  # pylint: disable=broad-except
        print(traceback.format_exc()[-3000:], flush=True)
        rows += [_error_row(run_mode, d, fam, md, e, round(time.time() - t, 3)) for md in group]
      print(f"[{run_mode} D={d} {fam}] {round(time.time() - t, 2)} s (compile {compile_s} s)",
            flush=True)
  return rows


# ---------------------------------------------------------------------------
# The rule per mode and D (the tuner's and the gate's input).
# ---------------------------------------------------------------------------


def rule_table(rows, modes) -> dict:
  """{run_mode: {D: {mode: numerics.rule_verdict}}} and "by_d": {D: {mode: ...}} over the GPU run
  modes (holds: false if any run mode fails, true if one holds and none fails, else null;
  allowed: guaranteed or holds). Always judged on all of numerics.FAMILIES: a run over fewer
  families cannot establish the rule."""
  table = {}
  for r in rows:
    table.setdefault(r["mode"], {}).setdefault(str(r["d"]), {}).setdefault(
        r["numerics"], []).append(r)
  out = {run_mode: {d: {md: numerics.rule_verdict(v, families=numerics.FAMILIES)
                        for md, v in by_mode.items()}
                    for d, by_mode in by_d.items()}
         for run_mode, by_d in table.items()}
  by_d = {}
  for run_mode in DEVICE_RUN_MODES:
    for d, by_mode in out.get(run_mode, {}).items():
      for md, v in by_mode.items():
        by_d.setdefault(d, {}).setdefault(md, []).append((run_mode, v))
  combined = {}
  for d, by_mode in sorted(by_d.items(), key=lambda kv: int(kv[0])):
    combined[d] = {}
    for md in modes:
      verdicts = by_mode.get(md, [])
      holds = [v["holds"] for _, v in verdicts]
      h = False if False in holds else (True if True in holds else None)
      combined[d][md] = dict(
          holds=h, guaranteed=md in numerics.GUARANTEED_MODES,
          allowed=md in numerics.GUARANTEED_MODES or h is True,
          max=max((v["max"] for _, v in verdicts if v["max"] is not None), default=None),
          run_modes={rm: v["holds"] for rm, v in verdicts})
  out["by_d"] = combined
  return out


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
  """Per numerics mode: how the kernel's output `run(f)` matches each mode's fused emulation
  (from the XLA partials), or the error that building (an Exception in fused_fs) or running it
  raised."""
  rows = {}
  for md, f in fused_fs.items():
    if isinstance(f, Exception):
      rows[md] = f"{type(f).__name__}: {f}"[:500]
      continue
    try:
      rows[md] = dict(vs_fused_emulation=_fused_matches(run(f), partials))
    except Exception as e:  # pylint: disable=broad-except
      rows[md] = f"{type(e).__name__}: {e}"[:500]
  return rows


def _fused_matches(out, partials) -> dict:
  return {md: _bits_equal_fraction(out, numerics.fused_owner_sum(partials, mode=md))
          for md in numerics.MODE_NAMES}


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


def baseline_multi_gpu(d, families, modes, out_path: Path) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  p = problem(d)
  mesh = _mesh(d)
  specs = dict(mesh=mesh, in_specs=(P(None, AXIS), P(AXIS, None)), check_vma=False)

  # The unfused path with its GEMM in the cast form (not `reference.dot`'s): the emulations
  # start from fp32 partials, and only the cast form's bf16 partial is exactly their rounding
  # (XLA's bf16-output GEMM may accumulate in another order). The question here is the
  # reduce-scatter's order, which the GEMM's form does not change.
  def user(x, w):
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
  for md in modes:
    try:
      cfg = make_config(d, md)
      fused_fs[md] = jax.jit(jax.shard_map(
          functools.partial(fused.fused_matmul_reduce_scatter, axis_name=AXIS, num_devices=d,
                            config=cfg), out_specs=P(AXIS, None), **specs))
    except Exception as e:  # pylint: disable=broad-except
      fused_fs[md] = e
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


def baseline_loopback(ds, families, modes, out_path: Path, budget) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  results = []
  for d in ds:
    p = problem(d)
    res = dict(d=d, shape=p, inputs=[])
    if budget.exceeded():
      results.append(dict(res, error="skipped (time budget)", skipped=True))
      continue
    try:
      def parts_and_ref(xs, ws):
        part = jnp.einsum("dmk,dkn->dmn", xs, ws, preferred_element_type=jnp.float32)
        return part, reference.loopback_matmul_reduce_scatter(xs, ws)
      parts_f = jax.jit(parts_and_ref)
      fused_fs = {}
      for md in modes:
        try:
          fused_fs[md] = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter,
                                                   config=make_config(d, md)))
        except Exception as e:  # pylint: disable=broad-except
          fused_fs[md] = e
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


def default_out(run_modes) -> Path:
  date = datetime.date.today().isoformat()
  return bench_env.default_out(f"{date}_numerics_{'_'.join(run_modes)}.json")


def print_rules(rule: dict) -> None:
  print("\nrule (max ratio <= 1.1 over >= "
        f"{numerics.MIN_RULE_INPUTS} inputs x each family; null: not established):")
  for run_mode, by_d in rule.items():
    if run_mode == "by_d":
      continue
    for d, by_mode in by_d.items():
      for md, v in by_mode.items():
        print(f"  {run_mode:<10} D={d:<2} {md:<14} holds={v['holds']}  ({v['reason']})")
  for d, by_mode in rule.get("by_d", {}).items():
    allowed = [md for md, v in by_mode.items() if v["allowed"]]
    print(f"  GPU D={d}: allowed {allowed}")


def print_table(rows) -> None:
  print("\nrun mode   D  family          mode           max    p99    median  >1.1/N      "
        "worst_seed  identical")
  for r in rows:
    head = f"{r['mode']:<10} {r['d']:<2} {r['family']:<15} {r['numerics']:<14}"
    if "error" in r:
      print(f"{head} {'skipped' if r.get('skipped') else 'ERROR: ' + r['error'][:60]}")
      continue
    print(f"{head} {bench_env.fmt(r['max'], '.3f'):<6} {bench_env.fmt(r['p99'], '.3f'):<6} "
          f"{bench_env.fmt(r['median'], '.3f'):<7} "
          f"{r['num_over_bound']:>4}/{r['num_inputs']:<6} {r['worst_seed']:<11} "
          f"{r['identical_share']:.4%}")


def _multi_ds(jax) -> list[int]:
  if _MULTI_D.value:
    return [int(v) for v in _MULTI_D.value]
  n_dev = len(jax.devices())
  return [v for v in (2, 4, 8) if v <= n_dev]


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  for flag, values, allowed in (("mode", _MODE.value, RUN_MODES), ("what", _WHAT.value, WHATS),
                                ("modes", _NMODES.value, numerics.MODE_NAMES)):
    if not values:
      raise app.UsageError(f"--{flag} is empty: name some of {list(allowed)}")
    flag_checks.subset(flag, values, allowed)
  flag_checks.subset("families", _FAMILIES.value, numerics.FAMILIES)
  flag_checks.positive_ints("num_devices", _DS.value)
  flag_checks.positive_ints("multi_gpu_devices", _MULTI_D.value)
  flag_checks.positive_ints("shape", _SHAPE.value)
  if len(_SHAPE.value) != 3:
    raise app.UsageError(f"--shape={_SHAPE.value} must be chunk_m,n,k_shard")


def main(argv):
  del argv
  check_flags()
  run_modes = list(_MODE.value)
  whats = list(_WHAT.value)
  modes = list(_NMODES.value)
  out_path = Path(_OUT.value) if _OUT.value else default_out(run_modes)
  if "numerics" not in out_path.name:
    raise app.UsageError(f"--out={out_path}: the file name must contain 'numerics'")
  if "multi_gpu" in run_modes:
    bench_env.configure_environment("multi_gpu")  # NCCL_NVLS_ENABLE=0, refuses multicast.
  import jax  # pylint: disable=g-import-not-at-top
  if run_modes == ["emulate"] and not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")  # The generator only; never grab a GPU.
  ds = [int(v) for v in _DS.value]
  fams, num = list(_FAMILIES.value), _NUM.value
  budget = Budget(_BUDGET.value)
  multi_ds = _multi_ds(jax) if "multi_gpu" in run_modes else []
  result = dict(environment=bench_env.environment_block(sys.argv),
                flags=dict(mode=run_modes, what=whats, modes=modes, num_devices=ds,
                           multi_gpu_devices=multi_ds, families=fams, num_inputs=num,
                           shape=_SHAPE.value, seed=_SEED.value, time_budget_s=_BUDGET.value,
                           baseline_inputs=_BASELINE_INPUTS.value),
                numerics_modes={md: dict(zip(("partial_dtype", "owner_sum"),
                                             numerics.NUMERICS_MODES[md])) for md in modes},
                unfused_baselines={k: v for k, v in UNFUSED_BASELINES.items() if k in run_modes},
                input_recipe=("numerics.family_inputs(jax.random.fold_in(jax.random.key(seed), "
                              "worst_seed), family, m=shape.m, k=shape.k, n=shape.n), split "
                              "along k by numerics.split_inputs"),
                rule_bound=numerics.RULE_BOUND, min_rule_inputs=numerics.MIN_RULE_INPUTS,
                cases=[], baseline={}, rule={})
  if set(run_modes) - {"emulate"}:
    result["kernel_reads"] = kernel_reads_numerics()
  save = lambda: bench_env.write_json(out_path, bench_env.sanitize(result), allow_nan=False)
  t_start = time.time()

  # The NVLink baseline first: it is short and settles what the unfused path computes.
  if "baseline" in whats and "multi_gpu" in run_modes:
    result["baseline"]["multi_gpu"] = []
    for d in multi_ds:
      try:
        res = baseline_multi_gpu(d, fams, modes, out_path)
      except Exception as e:  # pylint: disable=broad-except
        print(traceback.format_exc()[-3000:], flush=True)
        res = dict(d=d, error=f"{type(e).__name__}: {e}"[:1500])
      result["baseline"]["multi_gpu"].append(res)
      save()
  if "sweep" in whats:
    for run_mode in [m for m in DEVICE_RUN_MODES if m in run_modes] + (
        ["emulate"] if "emulate" in run_modes else []):
      for d in (multi_ds if run_mode == "multi_gpu" else ds):
        if run_mode == "multi_gpu" and (d < 2 or d > len(jax.devices())):
          result["cases"] += [_error_row(run_mode, d, fam, md, RuntimeError(
              f"multi_gpu D={d} needs 2 <= D <= {len(jax.devices())} visible devices"))
                              for fam in fams for md in modes]
          continue
        if run_mode != "emulate":
          result["cases"] += device_cases(run_mode, d, fams, modes, num, budget)
          save()
          continue
        for fam in fams:
          if budget.exceeded():
            result["cases"] += _skipped_rows(run_mode, d, [fam], modes)
            continue
          t = time.time()
          stats = emulate_case(d, fam, modes, num)
          rows = _case_rows(run_mode, d, fam, modes, stats, np.arange(num),
                            seconds=round(time.time() - t, 2))
          result["cases"] += rows
          print(f"[emulate D={d} {fam}] {rows[0]['seconds']} s", flush=True)
        save()
    result["rule"] = rule_table(result["cases"], modes)
    save()
  # The loopback baseline last: the sweep's identical shares already compare the kernel with
  # the XLA emulation; this adds the other modes' emulations and the HLO.
  if "baseline" in whats and "loopback" in run_modes:
    result["baseline"]["loopback"] = baseline_loopback(ds, fams, modes, out_path, budget)
    save()
  result["total_seconds"] = round(time.time() - t_start, 1)
  save()
  for part, res in result["baseline"].items():
    for r in res:
      exact = r.get("user_program_bit_exact_with", r.get("xla_emulation_bit_exact_with"))
      print(f"\nbaseline {part} D={r.get('d')}: {r.get('error') or ''} bit-exact with the "
            f"emulation(s) {exact}")
      for k, v in (r.get("summary") or {}).items():
        print(f"  {k}: {v:.4f}")
  if result["rule"]:
    print_rules(result["rule"])
  print(f"\n{out_path}  ({result['total_seconds']} s)")
  print_table(result["cases"])
  bad = [r for r in result["cases"] if "error" in r and not r.get("skipped")]
  return 1 if bad else 0


if __name__ == "__main__":
  app.run(main)
