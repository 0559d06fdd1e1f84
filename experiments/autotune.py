"""Autotuner: measures fused vs XLA per shape and writes the tuning table.

One H200, the D = 1 GEMM side of the 16 seed shapes (then the loopback
protocol at each case's D with the best 2 configs, informational):

  PYTHONPATH=. python experiments/autotune.py --mode=single_gpu --tags=seed \\
      --max_configs=6 --iterations=20

All visible GPUs, the real fused path under shard_map vs dot + psum_scatter
(T_seq); sets the gate at that D:

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/autotune.py \\
      --mode=multi_gpu --tags=seed --max_configs=4 --iterations=50

The backward's all-gather matmul (jax's collective_matmul_mgpu, `pallas_rs.kernel.ag_matmul`) is gated
by its own entries (op "ag_matmul"), measured per shape and D with --op=ag_matmul: per case, the
row-parallel backward's dx = all_gather(dy) @ w.T (dy [m/D, n], w.T [n, k_shard]), the kernel
with its default config, then each CTA tile of `candidates.ag_tile_variants` (up to
--max_configs in all), vs XLA's all-gather + dot:

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/autotune.py \\
      --mode=multi_gpu --op=ag_matmul --tags=seed --iterations=50

Per shape: every candidate config (`pallas_rs.tuning.candidates.candidate_configs`:
`default_config` first, then one-field variants; at most --max_configs) and
the XLA baseline are timed on the same random-normal bf16 inputs with
`pallas_rs.bench.timing.time_function` (CUPTI on GPU); every output is checked
against an f32-output reference (fused error <= 1.1x the XLA error, the seed
rule). Only "exceeds available shared memory" ValueErrors and
NotImplementedError are caught (recorded per config); anything else stops the
run. The best correct config goes into a table entry, implementation "fused"
only if its median beats XLA's (by --margin). The one pass screens: XLA, the
incumbent (the first candidate) and the pass's pick are timed again together,
--confirm_rounds rounds of --iterations calls, call by call in turn with CUPTI
(`pallas_rs.bench.alternating`), and a challenger replaces the incumbent, and fused beats XLA,
only on those times (by --margin). Entries are merged into --table
(new replaces same key) after each shape, and the raw records go to --out.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
import sys
import time
from typing import Any, Sequence

from absl import app
from absl import flags
from absl import logging

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent
for _path in (_REPO, _HERE):
  if str(_path) not in sys.path:
    sys.path.insert(0, str(_path))

import bench_env  # pylint: disable=g-import-not-at-top,wrong-import-position
from config_variants import tuned_config  # pylint: disable=g-import-not-at-top,wrong-import-position
import flag_checks  # pylint: disable=g-import-not-at-top,wrong-import-position

AXIS = "tp"
SMEM_ERROR = "exceeds available shared memory"

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "single_gpu", ["single_gpu", "multi_gpu"],
                  "single_gpu: D = 1 GEMM (+ loopback); multi_gpu: all GPUs.")
flags.DEFINE_list("names", None, "Shape names from pallas_rs.shapes.")
flags.DEFINE_list("tags", ["seed"], "Shape tags (all must match).")
flags.DEFINE_integer("num_devices", None, "multi_gpu: D (default: all visible "
                     "GPUs); single_gpu: loopback D (default: the case's).")
flags.DEFINE_integer("iterations", 30, "Timed iterations per function.")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_integer("max_configs", 6, "Candidate configs per shape (<= 0: all).")
flags.DEFINE_enum("candidates", "search", ["search", "comm", "tiles", "owner", "order",
                                           "prefetch", "spread"],
                  "multi_gpu: 'search' = candidates.candidate_configs (default config and "
                  "one-field variants); 'comm' = the config the gate runs now for the shape "
                  "(table or default) with each way of moving the partials "
                  "(candidates.comm_variants: direct push, pulling / pushing comm CTAs); "
                  "'tiles' = that config with each CTA tile shape (candidates.tile_variants: "
                  "small M; at D = 2 the challengers with the owner's TMA add); 'owner' = "
                  "that config with and without the owner's TMA add "
                  "(candidates.owner_variants: D = 2); 'order' = that config with each tile "
                  "order (candidates.order_variants: large M); 'prefetch' = that config "
                  "with prefetch_tiles switched, and with it one pipeline step deeper or "
                  "shallower (candidates.prefetch_variants); 'spread' = that config with "
                  "spread_stores switched (candidates.spread_variants).")
flags.DEFINE_bool("loopback", True, "single_gpu: also time the loopback at the "
                  "case's D with the best 2 configs (informational entries).")
flags.DEFINE_float("margin", 0.0, "Choose fused only if its median < (1 - "
                   "margin) * the XLA median, and a config over the first "
                   "candidate (the incumbent) only if it beats it by the same margin.")
flags.DEFINE_integer("confirm_rounds", 2, "After one pass over the candidates, "
                     "time XLA, the incumbent and the pass's pick again in this many rounds "
                     "of --iterations calls each, call by call in turn (CUPTI), and decide "
                     "with --margin on those times alone (0: one pass decides).")
flags.DEFINE_float("max_error_ratio", 1.1, "Fused max rel error allowed, as a "
                   "multiple of the XLA path's (plus 1e-6).")
flags.DEFINE_string("table", "pallas_rs/tuning/data/tuning_table.json", "Tuning table "
                    "to merge the entries into (created if absent; '' = none).")
flags.DEFINE_string("out", "", "Raw JSON records; default "
                    "experiments/out/autotune_<mode>_<stamp>.json (git-ignored).")
flags.DEFINE_integer("seed", 0, "PRNG seed of the inputs.")
flags.DEFINE_enum("op", "matmul_rs", ["matmul_rs", "ag_matmul"], "Which op to tune: the "
                  "fused matmul + reduce-scatter, or the backward's all-gather matmul "
                  "(multi_gpu only; table entries with op='ag_matmul').")
flags.DEFINE_bool("dry_run", False, "List the shapes and candidate configs, "
                  "time nothing (works on CPU).")


# ---------------------------------------------------------------------------
# Output (environment block and JSON writing: bench_env).
# ---------------------------------------------------------------------------


def _merge_into_table(path: str, entries: list[dict]) -> None:
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  if not path or not entries:
    return
  p = Path(path) if Path(path).is_absolute() else _REPO / path
  old = tuning.load_table(p) if p.exists() else tuning.empty_table()
  new = {"schema_version": tuning.SCHEMA_VERSION, "entries": entries}
  tuning.save_table(p, tuning.merge_entries(old, new))


# ---------------------------------------------------------------------------
# Timing one candidate.
# ---------------------------------------------------------------------------


def _short(cfg) -> str:
  if cfg is None:
    return "-"
  # The CTA tile (warpgroups side by side along N, or "/M" along M), pipeline, grid order,
  # receive stages (or "+add": the owner's TMA add, which has none), eager signals, comm CTAs.
  return (f"m{cfg.tile_m}n{cfg.tile_n}{'/M' if cfg.wg_dimension.name == 'M' else ''}"
          f"s{cfg.max_concurrent_steps}"
          f"{cfg.grid_minor_dim.name}w{cfg.grid_tile_width}"
          + ("+add" if cfg.tma_add else f"r{cfg.recv_stages}")
          + (f"e{cfg.eager_signal_steps}" if cfg.eager_signal_steps else "")
          + (f"{'p' if cfg.comm_mode == 'pull' else 'c'}{cfg.comm_ctas}" if cfg.comm_ctas
             else ""))


def time_candidate(label: str, fn, args, ref, *, num_devices: int,
                   xla_err: float | None, cfg=None, lenient: bool = False,
                   keep: dict[int, Any] | None = None) -> dict[str, Any]:
  """Times and checks one function; SMEM/NotImplemented are recorded, not raised, and with
  `lenient` any failure to build or run (configs of jax's all-gather matmul, which CI cannot
  lower: it asks the device for its SM count). `keep` receives the compiled executable of a
  function that ran, by the record's id (for `_group_timer`)."""
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  rec: dict[str, Any] = {"label": label,
                         "config": tuning.config_to_json(cfg) if cfg else None}
  try:
    # Compile once here: time_function and the check reuse the executable.
    compiled, compile_s = timing.compile_function(fn, args)
    t = timing.time_function(compiled, args, iterations=FLAGS.iterations,
                             warmup=FLAGS.warmup, num_devices=num_devices)
    out = compiled(*args)
  except NotImplementedError as e:
    rec.update(status="not_implemented", error=str(e))
    return rec
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, ValueError) and SMEM_ERROR in str(e):
      rec.update(status="smem", error=str(e).splitlines()[0][:500])
    elif lenient:
      rec.update(status="failed", error=f"{type(e).__name__}: {str(e)[:500]}")
      logging.warning("  %s %s failed: %s", label, cfg, rec["error"])
    else:
      raise
    return rec
  if keep is not None:
    keep[id(rec)] = compiled
  err = float(reference.max_rel_error_on_device(out, ref))
  ok = xla_err is None or bench_env.rule_holds(err, xla_err, FLAGS.max_error_ratio, slack=1e-6)
  rec.update(status="ok" if ok else "wrong", timer=t.timer,
             median_us=t.median_us, times_us=[float(v) for v in t.times_us],
             compile_s=compile_s, max_rel_error=err,
             xla_max_rel_error=xla_err)
  logging.info("  %-22s %-18s %10.1f us  err %.2e  %s", label, _short(cfg),
               t.median_us, err, rec["status"])
  return rec


def _baseline(rec: dict[str, Any]) -> dict[str, Any]:
  """XLA's record, which every candidate is judged against and timed beside: a RuntimeError
  naming the case if it did not run or its error is not finite (nothing could be judged)."""
  if rec.get("status") != "ok" or not math.isfinite(rec.get("max_rel_error", math.nan)):
    raise RuntimeError(f"the XLA baseline {rec['label']!r} gave no usable result "
                       f"(status {rec.get('status')!r}: "
                       f"{rec.get('error') or rec.get('max_rel_error')!r}): no candidate can be "
                       "judged against it")
  return rec


def _best(recs, margin: float = 0.0):
  """The fastest candidate, unless it beats the first one (the incumbent: the default or the
  table's config) by no more than `margin`: then the incumbent (a win within the run-to-run
  spread is not a win)."""
  ok = [r for r in recs if r.get("status") == "ok"]
  if not ok:
    return None
  best = min(ok, key=lambda r: r["median_us"])
  return best if best["median_us"] < (1 - margin) * ok[0]["median_us"] else ok[0]


def _decide(xla, recs, time_group, margin: float, fallbacks: bool = True):
  """(best, fallback) of the candidates `recs` (the first correct one the incumbent) against
  XLA's record `xla`. `_best` on the one pass screens; then, unless `time_group` is None (one
  pass decides) or nothing is correct, XLA, the incumbent, the pass's pick and (with
  `fallbacks`: pallas_rs configs) a pulling pick's fallback (`_fallback`) are timed again
  together (`time_group(records)` -> their `Timing`s: `_group_timer`), and both the margin rule
  and the entry's fused vs XLA comparison use those times alone ("times_us", "median_us"; the
  pass's stay in "pass_times_us", "pass_median_us").

  One pass of 20 iterations per candidate, timed one after another, did not separate candidates
  within ~7% (seventy-fifth session, BUILD_NOTES), and a GPU's slow phases last 0.1-0.4 s
  (seventy-seventh): times from different passes compare phases, so the decision pools none."""
  fallback = _fallback if fallbacks else lambda *_: None
  best = _best(recs, margin)
  if time_group is None or best is None:
    return best, fallback(recs, best)
  ok = [r for r in recs if r.get("status") == "ok"]
  pair = [ok[0]] + ([best] if best is not ok[0] else [])
  spare = fallback(recs, best)
  group = [xla] + pair + ([spare] if spare and all(spare is not r for r in pair) else [])
  for r, t in zip(group, time_group(group)):
    logging.info("  decide %-10s %-18s %10.1f us (median of %d; pass %.1f)", r["label"],
                 _short_record(r), t.median_us, len(t.times_us), r["median_us"])
    r.update(pass_times_us=r["times_us"], pass_median_us=r["median_us"])
    r.update(times_us=[float(v) for v in t.times_us], median_us=t.median_us,
             timing_rule=t.rule)
  best = _best(pair, margin)
  return best, fallback(group[1:], best)


def _group_timer(compiled: dict[int, Any], args, num_devices: int, rounds: int):
  """`time_group` for `_decide`: the records' executables (`compiled`, by the record's id:
  `time_candidate`'s `keep`) on `args`, `rounds` x --iterations calls each in `rounds` rounds,
  call by call in turn with CUPTI (`alternating.time_alternating`); None for `rounds` <= 0
  (one pass decides)."""
  from pallas_rs.bench import alternating  # pylint: disable=g-import-not-at-top
  if rounds <= 0:
    return None

  def time_group(records):
    got = alternating.time_alternating(
        {i: (compiled[id(r)], args) for i, r in enumerate(records)},
        iterations=rounds * FLAGS.iterations, rounds=rounds, warmup=FLAGS.warmup,
        num_devices=num_devices)
    return [got[i] for i in range(len(records))]
  return time_group


def _short_record(rec) -> str:
  """`_short` of a record's config; "-" for XLA, the JSON for other kernels' configs."""
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  if not rec.get("config"):
    return "-"
  try:
    return _short(tuning.config_from_json(rec["config"]))
  except (KeyError, TypeError, ValueError):
    return str(rec["config"])


def _decided_on() -> str:
  """How an entry's times were taken, for its "measured_with"."""
  if FLAGS.confirm_rounds <= 0:
    return f"one pass of {FLAGS.iterations} iterations each decides"
  return (f"decided on {FLAGS.confirm_rounds} x {FLAGS.iterations} iterations of XLA, the "
          "incumbent and the pass's pick timed again in turn (call by call with CUPTI)")


def _reads_peers(cfg_json) -> bool:
  """Whether a candidate's config (JSON; None for XLA) TMA-loads from peers
  (Config.reads_peers: jax >= 0.11.2 on devices)."""
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  return cfg_json is not None and tuning.config_from_json(cfg_json).reads_peers


def _fallback(recs, best):
  """The fastest correct candidate record that reads no peer, where `best` does (remote TMA
  loads: jax >= 0.11.2 on devices): the table entry's "fallback"."""
  if not best or not _reads_peers(best.get("config")):
    return None
  ok = [r for r in recs if r.get("status") == "ok" and not _reads_peers(r.get("config"))]
  return min(ok, key=lambda r: r["median_us"]) if ok else None


def _gate_entry(*, gpu_kind, d, m, n, k_shard, best, xla, env, mode,
                measured_with, op="matmul_rs", fallback=None) -> dict[str, Any]:
  from pallas_rs.tuning import schema  # pylint: disable=g-import-not-at-top
  return schema.make_entry(
      op=op, gpu_kind=gpu_kind, num_devices=d, m=m, n=n, k_shard=k_shard,
      fused_us=best["times_us"] if best else [], xla_us=xla["times_us"] if xla else [],
      config_json=best["config"] if best else None, margin=FLAGS.margin, env=env,
      measured_with=measured_with, mode=mode,
      fallback=(fallback["config"], fallback["times_us"]) if fallback else None)


# ---------------------------------------------------------------------------
# single_gpu: D = 1 GEMM, then loopback (informational).
# ---------------------------------------------------------------------------


def tune_single_gpu(case, env) -> tuple[list[dict], list[dict]]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import candidates  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top

  m, n, k_shard = case.m, case.n, case.k_shard
  gpu_kind = env["device_kind"]
  x, w = testing.generate(FLAGS.seed, m, k_shard, n)
  ref = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32,
                                     precision="highest"))(x, w)
  xla_fn = jax.jit(reference.dot)
  compiled = {}
  records = [time_candidate("xla_dot", xla_fn, (x, w), ref, num_devices=1,
                            xla_err=None, keep=compiled)]
  xla = _baseline(records[0])
  xla_err = xla["max_rel_error"]
  for cfg in candidates.candidate_configs(m=m, n=n, k_shard=k_shard, num_devices=1,
                                      max_configs=FLAGS.max_configs):
    fn = jax.jit(functools.partial(fused.local_matmul, config=cfg))
    records.append(time_candidate("local_fused", fn, (x, w), ref, num_devices=1,
                                  xla_err=xla_err, cfg=cfg, keep=compiled))
  del ref
  fused_recs = records[1:]
  best, _ = _decide(xla, fused_recs, _group_timer(compiled, (x, w), 1, FLAGS.confirm_rounds),
                    FLAGS.margin, fallbacks=False)
  del compiled
  entries = [_gate_entry(
      gpu_kind=gpu_kind, d=1, m=m, n=n, k_shard=k_shard, best=best, xla=xla,
      env=env, mode="single_gpu",
      measured_with=(f"experiments/autotune.py --mode=single_gpu: "
                     f"fused.local_matmul vs jnp.dot, {xla['timer']}, "
                     f"{len(fused_recs)} configs, {_decided_on()}"))]
  for r in records:
    r.update(case=case.name, num_devices=1, m=m, n=n, k_shard=k_shard,
             mode="single_gpu")
  del x, w
  if FLAGS.loopback:
    lb_recs, lb_entry = tune_loopback(case, _loopback_picks(fused_recs), env)
    records += lb_recs
    if lb_entry:
      entries.append(lb_entry)
  return records, entries


def _loopback_picks(recs, count: int = 2) -> list[dict]:
  """The `count` fastest correct candidate records of the one pass, for the loopback: ranked
  on the pass's medians, the only times every candidate has, taken alike (`_decide` gives the
  records it times again new ones)."""
  ok = [r for r in recs if r.get("status") == "ok"]
  return sorted(ok, key=lambda r: r.get("pass_median_us", r["median_us"]))[:count]


def tune_loopback(case, ranked, env):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import candidates  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top

  d = FLAGS.num_devices or case.num_devices
  if d < 2 or case.k % d or case.m % d:
    return [], None
  m, n, k_shard = case.m, case.n, case.k // d
  cfgs = []
  for r in ranked:
    cfg = candidates.adapt_config(tuning.config_from_json(r["config"]), m=m, n=n,
                              k_shard=k_shard, num_devices=d)
    if cfg is not None and cfg not in cfgs:
      cfgs.append(cfg)
  if not cfgs:
    return [], None
  xs, ws = testing.stacked_inputs(FLAGS.seed + 1, d, m, k_shard, n)

  def partials(a, b):
    return jnp.einsum("dmk,dkn->dmn", a, b, preferred_element_type=jnp.float32)

  ref = jax.jit(lambda a, b: partials(a, b).reshape(d, d, m // d, n).sum(0))(xs, ws)

  @jax.jit
  def xla_ref(a, b):
    # As the unfused path: bf16 partials, then a bf16-rounded sum over sources.
    p = partials(a, b).astype(a.dtype).reshape(d, d, m // d, n)
    return p.astype(jnp.float32).sum(0).astype(a.dtype)

  recs = [_baseline(time_candidate("loopback_xla", xla_ref, (xs, ws), ref, num_devices=1,
                                   xla_err=None))]
  for cfg in cfgs:
    fn = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
    recs.append(time_candidate("loopback_fused", fn, (xs, ws), ref,
                               num_devices=1, xla_err=recs[0]["max_rel_error"],
                               cfg=cfg))
  for r in recs:
    r.update(case=case.name, num_devices=d, m=m, n=n, k_shard=k_shard,
             mode="loopback")
  entry = _gate_entry(
      gpu_kind=env["device_kind"], d=d, m=m, n=n, k_shard=k_shard,
      best=_best(recs[1:]), xla=recs[0], env=env, mode="loopback",
      measured_with=(f"experiments/autotune.py --mode=single_gpu --loopback: "
                     f"{d} virtual ranks on one GPU vs an XLA einsum+sum; "
                     f"informational, never gates real D > 1"))
  return recs, entry


# ---------------------------------------------------------------------------
# multi_gpu: the real fused path under shard_map vs dot + psum_scatter.
# ---------------------------------------------------------------------------


def tune_multi_gpu(case, env) -> tuple[list[dict], list[dict]]:
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  d = FLAGS.num_devices or len(devices)
  if d > len(devices):
    raise app.UsageError(f"--num_devices={d} but {len(devices)} devices")
  if case.k % d or case.m % d:
    logging.warning("%s: skip, m=%d and k=%d must be divisible by D=%d",
                    case.name, case.m, case.k, d)
    return [], []
  m, n, k_shard = case.m, case.n, case.k // d
  mesh = jax.sharding.Mesh(np.array(devices[:d]), (AXIS,))
  x_spec, w_spec, out_spec = P(None, AXIS), P(AXIS, None), P(AXIS, None)

  x, w = testing.generate(FLAGS.seed, m, case.k, n, num_devices=d,
                          shardings=testing.row_parallel_shardings(mesh, AXIS))

  def smap(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                                 out_specs=out_spec, check_vma=False))

  ref = smap(lambda a, b: lax.psum_scatter(
      jnp.dot(a, b, preferred_element_type=jnp.float32, precision="highest"),
      AXIS, scatter_dimension=0, tiled=True))(x, w)
  seq = smap(functools.partial(reference.matmul_reduce_scatter, axis_name=AXIS))
  compiled = {}
  records = [time_candidate("xla_seq", seq, (x, w), ref, num_devices=d,
                            xla_err=None, keep=compiled)]
  xla = _baseline(records[0])
  for cfg in multi_gpu_candidates(m=m, n=n, k_shard=k_shard, d=d):
    fn = smap(functools.partial(fused.fused_matmul_reduce_scatter, axis_name=AXIS,
                                num_devices=d, config=cfg))
    records.append(time_candidate("fused", fn, (x, w), ref, num_devices=d,
                                  xla_err=xla["max_rel_error"], cfg=cfg, keep=compiled))
  for r in records:
    r.update(case=case.name, num_devices=d, m=m, n=n, k_shard=k_shard,
             mode="multi_gpu")
  best, fallback = _decide(xla, records[1:], _group_timer(compiled, (x, w), d,
                                                          FLAGS.confirm_rounds),
                           FLAGS.margin)
  entry = _gate_entry(
      gpu_kind=env["device_kind"], d=d, m=m, n=n, k_shard=k_shard,
      best=best, xla=xla, env=env, mode="multi_gpu", fallback=fallback,
      measured_with=(f"experiments/autotune.py --mode=multi_gpu: fused under "
                     f"shard_map vs jnp.dot + psum_scatter (T_seq) on {d} GPUs, "
                     f"{xla['timer']} step time (max over devices), {_decided_on()}"))
  return records, [entry]


def multi_gpu_candidates(*, m: int, n: int, k_shard: int, d: int) -> list:
  """The configs --candidates names for one multi_gpu shape (bf16 inputs)."""
  from pallas_rs.tuning import candidates  # pylint: disable=g-import-not-at-top
  if FLAGS.candidates == "search":
    return candidates.candidate_configs(m=m, n=n, k_shard=k_shard, num_devices=d,
                                        max_configs=FLAGS.max_configs)
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  try:
    base = tuned_config(m=m, k_shard=k_shard, n=n, dtype="bfloat16", num_devices=d)
  except NotImplementedError:
    return []
  if FLAGS.candidates == "tiles":
    # The challengers with the owner's TMA add where it runs (Config.tma_add_can_run: the
    # same bits, measured cheaper), the incumbent as it is.
    tma_add = True if base.tma_add_can_run(d) else None
    cfgs = candidates.tile_variants(base, m=m, n=n, k_shard=k_shard, num_devices=d,
                                    tma_add=tma_add)
  elif FLAGS.candidates == "owner":
    cfgs = candidates.owner_variants(base, m=m, n=n, k_shard=k_shard, num_devices=d)
  elif FLAGS.candidates == "order":
    cfgs = candidates.order_variants(base, m=m, n=n, k_shard=k_shard, num_devices=d)
  elif FLAGS.candidates == "prefetch":
    cfgs = candidates.prefetch_variants(base, m=m, n=n, k_shard=k_shard, num_devices=d)
  elif FLAGS.candidates == "spread":
    cfgs = candidates.spread_variants(base, m=m, n=n, k_shard=k_shard, num_devices=d)
  else:
    cfgs = candidates.comm_variants(base, m=m, n=n, k_shard=k_shard, num_devices=d,
                                    pull=fused.remote_tma_loads_supported())
  if cfgs and all(c.reads_peers for c in cfgs):
    # A pulling entry needs a fallback measured in the same run (_fallback): the incumbent's.
    fallback = _table_fallback(m=m, n=n, k_shard=k_shard, d=d)
    if fallback is not None:
      cfgs.append(fallback)
  return cfgs


def _table_fallback(*, m: int, n: int, k_shard: int, d: int):
  """The fallback config of the active table's entry for the shape (None without one)."""
  from pallas_rs import platform  # pylint: disable=g-import-not-at-top
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  entry = tuning.exact_entry(tuning.make_key(
      m=m, n=n, k_shard=k_shard, dtype="bfloat16", num_devices=d,
      gpu_kind=platform.device_kind()), op="matmul_rs")
  return None if entry is None else tuning.entry_fallback(entry)


def ag_problem(case, d: int) -> dict[str, int]:
  """The all-gather matmul of the row-parallel backward of `case` at D = d: all_gather(dy)
  @ w.T with dy [m/D, n] and w.T [n, k_shard] (the tuning-table key: m gathered rows, k_shard
  the contraction n, n the output columns k_shard)."""
  return {"m_shard": case.m // d, "k": case.n, "n": case.k // d}


def ag_candidates(prob: dict[str, int]) -> list:
  """The all-gather matmul configs tried for `prob` (ag_problem): candidates.ag_tile_variants,
  the kernel's default first, at most --max_configs of them."""
  from pallas_rs.tuning import candidates  # pylint: disable=g-import-not-at-top
  cfgs = candidates.ag_tile_variants(prob["m_shard"], prob["k"], prob["n"])
  return cfgs[:FLAGS.max_configs] if FLAGS.max_configs > 0 else cfgs


def tune_ag_multi_gpu(case, env) -> tuple[list[dict], list[dict]]:
  """jax's fused all-gather matmul vs XLA's all-gather + dot, one entry (op "ag_matmul")."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import ag_matmul  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  d = FLAGS.num_devices or len(devices)
  prob = ag_problem(case, d)
  cfgs = []
  for cand in ag_candidates(prob):
    try:
      cfgs.append(ag_matmul.check_supported(**prob, dtype=jnp.bfloat16,
                                            out_dtype=jnp.bfloat16, num_devices=d,
                                            config=cand))
    except NotImplementedError as e:
      logging.warning("%s: all-gather matmul config does not apply: %s", case.name, e)
  if not cfgs:
    return [], []
  mesh = jax.sharding.Mesh(np.array(devices[:d]), (AXIS,))
  m, k, n = prob["m_shard"] * d, prob["k"], prob["n"]

  # lhs [m, k] gathered along rows, rhs [k, n * D] column-sharded: the operands of `generate`.
  lhs, rhs = testing.generate(FLAGS.seed, m, k, n * d, shardings=(
      NamedSharding(mesh, P(AXIS, None)), NamedSharding(mesh, P(None, AXIS))))

  def smap(body):
    return jax.jit(jax.shard_map(lambda a, b: body(a, b)[0], mesh=mesh,
                                 in_specs=(P(AXIS, None), P(None, AXIS)),
                                 out_specs=P(None, AXIS), check_vma=False))

  xla_fn = smap(functools.partial(reference.all_gather_matmul, axis_name=AXIS))
  ref = xla_fn(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  compiled = {}
  records = [_baseline(time_candidate("ag_xla", xla_fn, (lhs, rhs), ref, num_devices=d,
                                      xla_err=None, keep=compiled))]
  for cfg in cfgs:  # The kernel's default first: the incumbent of the margin rule.
    fused_fn = smap(functools.partial(ag_matmul.fused_all_gather_matmul, axis_name=AXIS,
                                      config=cfg, out_dtype=jnp.bfloat16))
    records.append(time_candidate("ag_fused", fused_fn, (lhs, rhs), ref, num_devices=d,
                                  xla_err=records[0]["max_rel_error"], lenient=True,
                                  keep=compiled))
    records[-1]["config"] = ag_matmul.config_to_json(cfg)
  for r in records:
    r.update(case=case.name, num_devices=d, m=m, n=n, k_shard=k, mode="multi_gpu",
             op="ag_matmul")
  best, _ = _decide(records[0], records[1:], _group_timer(compiled, (lhs, rhs), d,
                                                         FLAGS.confirm_rounds),
                    FLAGS.margin, fallbacks=False)
  entry = _gate_entry(
      gpu_kind=env["device_kind"], d=d, m=m, n=n, k_shard=k,
      best=best, xla=records[0], env=env, mode="multi_gpu",
      op="ag_matmul",
      measured_with=(f"experiments/autotune.py --mode=multi_gpu --op=ag_matmul: "
                     f"collective_matmul_mgpu ({len(cfgs)} configs: "
                     "candidates.ag_tile_variants) vs all_gather + jnp.dot on "
                     f"{d} GPUs, {records[0]['timer']} step time, {_decided_on()}"))
  return records, [entry]


# ---------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------


def select_cases():
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  cases = shapes.select(tags=FLAGS.tags, names=FLAGS.names)
  if not cases:
    raise app.UsageError(f"no shapes match --tags={FLAGS.tags} --names={FLAGS.names}")
  return cases


def format_summary(entries: list[dict]) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  lines = [f"{'mode':<10} {'D':>2} {'m':>6} {'n':>5} {'k_shard':>7} "
           f"{'xla_us':>9} {'fused_us':>9} {'x':>6}  {'config':<16} choice"]
  for e in entries:
    k = e["key"]
    f, x = e["times_us"]["fused"], e["times_us"]["xla"]
    fm = float(np.median(f)) if f else float("nan")
    xm = float(np.median(x)) if x else float("nan")
    cfg = (tuning.config_from_json(e["config"])
           if e["config"] and e.get("op", "matmul_rs") == "matmul_rs" else None)
    lines.append(f"{e['mode']:<10} {k['num_devices']:>2} {k['m']:>6} {k['n']:>5} "
                 f"{k['k_shard']:>7} {xm:>9.1f} {fm:>9.1f} {xm / fm:>6.2f}  "
                 f"{_short(cfg):<16} {e['implementation']}")
  return "\n".join(lines)


def dry_run(cases) -> None:
  from pallas_rs.tuning import candidates  # pylint: disable=g-import-not-at-top
  total = 0
  for case in cases:
    if FLAGS.op == "ag_matmul":
      d = FLAGS.num_devices or case.num_devices
      prob = ag_problem(case, d)
      cfgs = ag_candidates(prob)
      print(f"{case.name} (D={d}): ag_matmul {prob}: XLA and "
            + " ".join(f"m{c.tile_m}n{c.tile_n}/{c.wg_dimension.name}" for c in cfgs))
      total += len(cfgs) + 1
      continue
    if FLAGS.mode == "single_gpu":
      m, k_shard, d = case.m, case.k_shard, 1
    else:
      d = FLAGS.num_devices or case.num_devices
      m, k_shard = case.m, case.k // d
    cfgs = (multi_gpu_candidates(m=m, n=case.n, k_shard=k_shard, d=d)
            if FLAGS.mode == "multi_gpu" else
            candidates.candidate_configs(m=m, n=case.n, k_shard=k_shard, num_devices=d,
                                         max_configs=FLAGS.max_configs))
    total += len(cfgs) + 1
    print(f"{case.name} (D={d}, m={m}, n={case.n}, k_shard={k_shard}): "
          + " ".join(_short(c) for c in cfgs))
  loop = 3 * len(cases) if FLAGS.mode == "single_gpu" and FLAGS.loopback else 0
  print(f"{len(cases)} shapes, {total} timed functions (+ up to {loop} loopback)")


def check_flags():
  """UsageError for a flag value that would fail later in the run (flag_checks); else the
  shapes selected (`select_cases`, which refuses a selection with no shape)."""
  flag_checks.shape_names("names", FLAGS.names)
  flag_checks.shape_tags("tags", FLAGS.tags)
  flag_checks.positive_ints("iterations", [FLAGS.iterations])
  flag_checks.non_negative_ints("warmup", [FLAGS.warmup])
  flag_checks.non_negative_ints("confirm_rounds", [FLAGS.confirm_rounds])
  if FLAGS.num_devices is not None:
    flag_checks.positive_ints("num_devices", [FLAGS.num_devices])
  return select_cases()


def main(argv: Sequence[str]) -> int:
  # multi_gpu: NCCL_NVLS_ENABLE defaults to 0, anything else is refused.
  bench_env.configure_environment(FLAGS.mode)
  cases = check_flags()
  if FLAGS.dry_run:
    dry_run(cases)
    return 0
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    raise app.UsageError(f"autotune needs GPUs, backend is {jax.default_backend()!r}"
                         " (--dry_run lists the candidates on any machine)")
  env = bench_env.environment_block(argv)
  out = (Path(FLAGS.out) if FLAGS.out else
         bench_env.default_out(f"autotune_{FLAGS.mode}_{bench_env.utc_stamp()}.json"))
  if FLAGS.op == "ag_matmul" and FLAGS.mode != "multi_gpu":
    raise app.UsageError("--op=ag_matmul needs --mode=multi_gpu (the kernel needs >= 2 GPUs)")
  tune = {("single_gpu", "matmul_rs"): tune_single_gpu,
          ("multi_gpu", "matmul_rs"): tune_multi_gpu,
          ("multi_gpu", "ag_matmul"): tune_ag_multi_gpu}[FLAGS.mode, FLAGS.op]
  records, entries = [], []
  print(f"{len(cases)} shape(s); writing {out} after each shape", flush=True)
  start = time.perf_counter()
  for i, case in enumerate(cases):
    logging.info("[%d/%d] %s", i + 1, len(cases), case.name)
    recs, ents = tune(case, env)
    records += recs
    entries += ents
    # After every shape, so that a crash keeps what was measured.
    bench_env.write_json(out, {"env": env,
                               "flags": FLAGS.flags_into_string(),
                               "records": records, "entries": entries})
    _merge_into_table(FLAGS.table, ents)
    choices = ", ".join(f"D={e['key']['num_devices']} {e['implementation']}" for e in ents)
    print(f"[{i + 1}/{len(cases)}] {case.name} ({time.perf_counter() - start:.0f} s): "
          f"{len(recs)} timed, {choices or 'no entry'}", flush=True)
  print(format_summary(entries))
  print(f"raw records: {out}")
  if FLAGS.table:
    print(f"table: {FLAGS.table} ({len(entries)} entries merged)")
  return 0


if __name__ == "__main__":
  app.run(main)
