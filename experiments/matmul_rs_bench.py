r"""Benchmark of matmul + reduce-scatter: fused kernel vs XLA baselines.

Modes (`--mode`):
  multi_gpu   the real protocol on D visible GPUs (one process, shard_map).
              Per shape: T_gemm (jnp.dot alone), T_comm (psum_scatter of an
              [m, n] array alone), T_seq (dot then psum_scatter, one jit), then
              each of `--implementations` (fused, xla, auto) and, with
              `--xla_peer`, XLA's windowed-einsum collective matmul.
  single_gpu  one GPU: (a) D = 1, `pallas_rs.fused.local_matmul` vs XLA's dot
              on each shape's per-device GEMM [m, k/D] x [k/D, n]; (b) loopback:
              `pallas_rs.fused.loopback_matmul_reduce_scatter` (D virtual ranks
              on one GPU) vs an XLA loopback reference, at D = 8 and
              `--num_devices`.
  smoke       CPU, 8 forced host devices, small "ci" shapes, XLA paths only
              (fused is attempted if asked and recorded as unavailable). Host
              wall clock: NO PERFORMANCE CLAIMS.
  auto        multi_gpu with >= 2 GPUs, single_gpu with 1, else smoke.

Every timed output is checked on fresh random inputs against an fp32/fp64
numpy reference (`--check`, on by default): max relative error
max|out - ref| / max|ref| and its ratio to the unfused path's (seed rule:
<= `--max_error_ratio` = 1.1).

An implementation that raises NotImplementedError (the fused kernel before it
lands, or on an unsupported platform) is recorded as "unavailable: <reason>",
never timed and never faked. Any other exception stops the run unless
`--keep_going` (then "failed: <reason>" and a non-zero exit code).

Output: a JSON file (`--out`, default experiments/results/<mode>_<date>.json)
with an environment block and one record per (shape, implementation, mode);
see `validate_record`. A short table is printed at the end.

  python experiments/matmul_rs_bench.py --mode=smoke
  python experiments/matmul_rs_bench.py --mode=multi_gpu --tags=seed --xla_peer
  python experiments/matmul_rs_bench.py --mode=single_gpu --tags=seed
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import datetime
import functools
import math
from pathlib import Path
import sys
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import numpy as np

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent
for _path in (_REPO, _HERE):
  if str(_path) not in sys.path:
    sys.path.insert(0, str(_path))

# pylint: disable=g-import-not-at-top,wrong-import-position
import bench_env
from bench_env import configure_environment  # also used by the tests
from bench_env import fmt
from bench_env import MODES
from bench_env import NO_CLAIMS
from bench_env import sanitize
from bench_env import SMOKE_DEVICES
from bench_records import AXIS
from bench_records import BASELINES
from bench_records import default_out_path
from bench_records import format_table
from bench_records import LEGEND
from bench_records import OVERLAP_IMPLEMENTATIONS
from bench_records import PEER
from bench_records import SCHEMA_VERSION
from bench_records import shape_block
from bench_records import TIMERS
from bench_records import validate_record
from bench_records import validate_results
from bench_records import WINDOWED_EINSUM_OPTION
# pylint: enable=g-import-not-at-top,wrong-import-position

# No jax (nor pallas_rs, which imports jax) at module level: XLA_FLAGS (smoke's
# forced host devices) must be set before jax is first imported, which
# `configure_environment` does in main().

# Above this many reference FLOPs the check uses float32 BLAS (summed in
# float64) instead of float64: minutes saved at the seed shapes, error of the
# reference ~1e-6 relative, far below bf16's 4e-3.
FP64_REFERENCE_MAX_FLOPS = 2e9

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "auto", MODES, "What to run; see the module doc.")
flags.DEFINE_list("tags", None, "Shape tags (all must match); default: 'ci' in "
                  "smoke mode, 'seed' otherwise.")
flags.DEFINE_list("names", None, "Shape names from pallas_rs.shapes.")
flags.DEFINE_integer("m", None, "Custom shape: global m (with --n, --k).")
flags.DEFINE_integer("n", None, "Custom shape: n.")
flags.DEFINE_integer("k", None, "Custom shape: global k.")
flags.DEFINE_string("dtype", "bfloat16", "dtype of a custom shape.")
flags.DEFINE_integer("num_devices", None, "D. multi_gpu/smoke: devices used "
                     "(default: all visible devices for the 'seed' shapes, each "
                     "other shape's own D, e.g. 2 for 'proxy8'; must be <= visible); "
                     "single_gpu: extra loopback D besides 8; custom shapes: "
                     "their D (default 8).")
flags.DEFINE_list("implementations", None,
                  f"Among {OVERLAP_IMPLEMENTATIONS}; default 'xla' in smoke "
                  "mode, 'fused' otherwise. Baselines are always timed.")
flags.DEFINE_integer("iterations", 200, "Timed iterations per function.")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_enum("timer", "auto", TIMERS, "auto: cupti on GPU, host wall "
                  "clock on CPU.")
flags.DEFINE_string("out", "", "JSON output path; default "
                    "experiments/results/<mode>_<UTC date>.json.")
flags.DEFINE_bool("check", True, "Check every timed output on fresh inputs.")
flags.DEFINE_float("max_error_ratio", 1.1, "Allowed max-rel-error ratio to the "
                   "unfused path.")
flags.DEFINE_bool("xla_peer", False, "multi_gpu: also time XLA's windowed-"
                  "einsum collective matmul (auto-sharded dot, compiled with "
                  f"{WINDOWED_EINSUM_OPTION}=0).")
flags.DEFINE_bool("keep_going", False, "Record unexpected exceptions as "
                  "'failed: ...' and continue (exit code 1 at the end).")
flags.DEFINE_integer("seed", 0, "PRNG seed (timing inputs; check inputs use "
                     "seed + 1).")
flags.DEFINE_float("peak_flops", None, "Peak FLOP/s for the roofline "
                   "estimates; default pallas_rs.metrics."
                   "MEASURED_PEAK_FLOPS_BF16 (measured bf16 dense).")
flags.DEFINE_float("bus_bandwidth", None, "Reduce-scatter bus bandwidth (B/s) "
                   "for the estimates; default pallas_rs.metrics."
                   "MEASURED_RS_BUS_BANDWIDTH (measured NCCL busbw).")
_FLAG_NAMES = ("mode", "tags", "names", "m", "n", "k", "dtype", "num_devices",
               "implementations", "iterations", "warmup", "timer", "out",
               "check", "max_error_ratio", "xla_peer", "keep_going", "seed",
               "peak_flops", "bus_bandwidth")


# ---------------------------------------------------------------------------
# Shapes.
# ---------------------------------------------------------------------------


def select_cases(mode: str) -> list[Any]:
  """The shapes to run, from --m/--n/--k or --names/--tags (mode default)."""
  from pallas_rs import shapes  # pylint: disable=g-import-not-at-top
  custom = [FLAGS.m, FLAGS.n, FLAGS.k]
  if any(v is not None for v in custom):
    if not all(v is not None for v in custom):
      raise app.UsageError(f"--m, --n and --k go together, got {custom=}")
    d = FLAGS.num_devices or (SMOKE_DEVICES if mode != "single_gpu" else 8)
    return [shapes.custom_case(FLAGS.m, FLAGS.n, FLAGS.k, d, FLAGS.dtype)]
  tags = FLAGS.tags
  if tags is None and FLAGS.names is None:
    tags = ["ci"] if mode == "smoke" else ["seed"]
  cases = list(shapes.select(tags=tags, names=FLAGS.names))
  if not cases:
    raise app.UsageError(f"no shape matches --tags={tags} --names={FLAGS.names}")
  return cases


# ---------------------------------------------------------------------------
# Inputs and the numpy reference.
# ---------------------------------------------------------------------------


def _random_global(key, m, k, n, dtype, mesh, x_spec, w_spec):
  """x [m, k], w [k, n] generated directly in their shardings."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  def gen(key):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / math.sqrt(k)
    return x.astype(dtype), w.astype(dtype)

  shardings = None
  if mesh is not None:
    shardings = (NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec))
  return jax.jit(gen, out_shardings=shardings)(key)


def stream_reference(xs: np.ndarray, ws: np.ndarray, *,
                     gemm_outs: np.ndarray | None = None):
  """Numpy oracle over stacked inputs, one device's GEMM at a time.

  Args:
    xs: [D, m, k_shard]; ws: [D, k_shard, n] (any float dtype).
    gemm_outs: optional [D, m, n] per-device GEMM outputs to check on the way.

  Returns:
    (reference [D, m // D, n] float64, label, gemm_max_rel_error or None).
    float64 products below FP64_REFERENCE_MAX_FLOPS (the same maths as
    pallas_rs.reference.numpy_reference), float32 BLAS summed in float64 above.
  """
  num_devices, m, k_shard = xs.shape
  n = ws.shape[-1]
  flops = 2.0 * num_devices * m * k_shard * n
  acc_dtype = np.float64 if flops <= FP64_REFERENCE_MAX_FLOPS else np.float32
  label = ("numpy float64" if acc_dtype == np.float64 else
           "numpy float32 BLAS per device, summed in float64")
  total = np.zeros((m, n), np.float64)
  num = den = 0.0
  for d in range(num_devices):
    part = np.asarray(xs[d]).astype(acc_dtype) @ np.asarray(ws[d]).astype(
        acc_dtype)
    if gemm_outs is not None:
      num = max(num, float(np.max(np.abs(gemm_outs[d].astype(np.float64) - part),
                                  initial=0.0)))
      den = max(den, float(np.max(np.abs(part), initial=0.0)))
    total += part
  gemm_err = None
  if gemm_outs is not None:
    gemm_err = num / den if den else (0.0 if num == 0 else math.inf)
  return np.stack(np.split(total, num_devices, axis=0)), label, gemm_err


def max_rel_error(out, ref) -> float:
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  return reference.max_rel_error(out, ref)


def _to_numpy(a) -> np.ndarray:
  return np.asarray(a).astype(np.float32)


# ---------------------------------------------------------------------------
# Running one implementation.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
  """One function to time and check.

  `build()` returns (fn, args) for timing and (fn, check_args); fn must be a
  jitted function or a Compiled. `check(out)` returns the check dict.
  """
  implementation: str
  build: Callable[[], tuple[Any, tuple, tuple]]
  check: Callable[[Any], dict[str, Any]] | None
  flops: float
  bytes: float
  hlo_probe: Callable[[Any], dict[str, Any]] | None = None


def _status_of(e: BaseException) -> str:
  msg = " ".join(str(e).split())[:400]
  return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def run_candidate(mode: str, shape: dict[str, Any], cand: Candidate, *,
                  num_devices: int, timer: str) -> dict[str, Any]:
  """Compiles, times and checks one candidate; returns its record."""
  from pallas_rs import metrics  # pylint: disable=g-import-not-at-top
  from pallas_rs import timing as timing_lib  # pylint: disable=g-import-not-at-top
  record = {
      "mode": mode, "shape": shape, "implementation": cand.implementation,
      "status": "ok", "timer": None, "performance_claims": False,
      "timing": None, "check": None, "throughput": None, "metrics": None,
      "estimates": None, "notes": [],
  }
  logging.info("[%s] %s: %s", mode, shape["name"], cand.implementation)
  try:
    fn, args, check_args = cand.build()
    compiled, compile_s = timing_lib.compile_function(fn, args)
    if cand.hlo_probe is not None:
      probe = cand.hlo_probe(compiled)
      record["hlo"] = probe
      record["notes"].extend(probe.get("notes", []))
    t = timing_lib.time_function(compiled, args, iterations=FLAGS.iterations,
                                 warmup=FLAGS.warmup, timer=timer,
                                 num_devices=num_devices)
    t.compile_s = compile_s
    if FLAGS.check and cand.check is not None:
      out = compiled(*check_args)
      record["check"] = cand.check(out)
      del out
  except NotImplementedError as e:
    record["status"] = f"unavailable: {_status_of(e)}"
    logging.info("  unavailable: %s", _status_of(e))
    return record
  except Exception as e:  # pylint: disable=broad-except
    if not FLAGS.keep_going:
      raise
    record["status"] = f"failed: {_status_of(e)}"
    logging.exception("  failed (--keep_going)")
    return record
  record["timer"] = t.timer
  record["performance_claims"] = t.timer == "cupti"
  if t.timer == "host_wall_clock":
    record["notes"].append(NO_CLAIMS)
  record["timing"] = t.to_json()
  med_s = t.median_us * 1e-6
  record["throughput"] = {
      "tflops": metrics.achieved_tflops(cand.flops, med_s) if med_s > 0 else None,
      "gbps": metrics.achieved_gbps(cand.bytes, med_s) if med_s > 0 else None,
  }
  logging.info("  median %.2f us (%s)%s", t.median_us, t.timer,
               "" if record["check"] is None else
               f", max rel err {record['check']['max_rel_error']:.3g}")
  return record


def _check_block(err: float, label: str, unfused_err: float | None,
                 apply_rule: bool) -> dict[str, Any]:
  ratio = None
  passed = True
  if unfused_err is not None:
    ratio = (err / unfused_err if unfused_err > 0 else
             (0.0 if err == 0 else math.inf))
    if apply_rule:
      passed = ratio <= FLAGS.max_error_ratio
  return {"max_rel_error": err, "reference": label,
          "unfused_max_rel_error": unfused_err, "ratio_to_unfused": ratio,
          "rule": (f"ratio_to_unfused <= {FLAGS.max_error_ratio}"
                   if apply_rule else None),
          "passed": passed}


def _peaks() -> dict[str, float]:
  """--peak_flops/--bus_bandwidth, defaulting to the measured figures."""
  from pallas_rs import metrics  # pylint: disable=g-import-not-at-top
  return {
      "peak_flops": FLAGS.peak_flops or metrics.MEASURED_PEAK_FLOPS_BF16,
      "bus_bandwidth": (FLAGS.bus_bandwidth
                        or metrics.MEASURED_RS_BUS_BANDWIDTH),
  }


def _median(record) -> float | None:
  if record is None or record["status"] != "ok":
    return None
  return record["timing"]["stats"]["median"]


# ---------------------------------------------------------------------------
# multi_gpu / smoke: the real protocol under shard_map.
# ---------------------------------------------------------------------------


def devices_for(case, visible: int, override: int | None = None) -> int:
  """D to run `case` at: --num_devices if given, all visible devices for a "seed" shape (the
  seed sweep runs on whatever GPU count the machine has), else the case's own D."""
  if override:
    return override
  if "seed" in case.tags:
    return visible
  return case.num_devices


def sweep_sharded(mode: str, cases, implementations, timer) -> list[dict]:
  """T_gemm, T_comm, T_seq, implementations (+ peer) per shape on a D mesh."""
  from pallas_rs import metrics  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import pallas_rs  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top

  records = []
  devices = jax.devices()
  for case in cases:
    d = devices_for(case, len(devices), FLAGS.num_devices)
    if d != case.num_devices:
      case = case.with_num_devices(d)
    if d > len(devices):
      raise app.UsageError(f"{case.name}: needs {d} devices, have "
                           f"{len(devices)} ({devices[0].platform})")
    if case.k % d or case.m % d:
      raise app.UsageError(f"{case.name}: k={case.k} and m={case.m} must be "
                           f"divisible by num_devices={d}")
    mesh = Mesh(np.array(devices[:d]), (AXIS,))
    dtype = jnp.dtype(case.dtype)
    itemsize = dtype.itemsize
    shape = shape_block(case)
    m, n, k_shard = case.m, case.n, case.k_shard
    x_spec, w_spec, out_spec = P(None, AXIS), P(AXIS, None), P(AXIS, None)
    gen = functools.partial(_random_global, m=m, k=case.k, n=n, dtype=dtype,
                            mesh=mesh, x_spec=x_spec, w_spec=w_spec)
    x, w = gen(jax.random.key(FLAGS.seed))
    cx, cw = gen(jax.random.key(FLAGS.seed + 1))

    def smap(body, in_specs, out_specs=out_spec, mesh=mesh):
      return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                   out_specs=out_specs, check_vma=False))

    def gemm_body(x, w, dtype=dtype):
      return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)

    def comm_body(y):
      return lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)

    def seq_body(x, w):
      return reference.matmul_reduce_scatter(x, w, axis_name=AXIS)

    gemm_fn = smap(gemm_body, (x_spec, w_spec))
    state: dict[str, Any] = {}

    def oracle():
      # Lazily: fp64/fp32 numpy over the check inputs, checking gemm en route.
      if "ref" not in state:
        xs = _to_numpy(cx).reshape(m, d, k_shard).transpose(1, 0, 2)
        ws = _to_numpy(cw).reshape(d, k_shard, n)
        gemm_outs = None
        if FLAGS.check:
          gemm_outs = _to_numpy(gemm_fn(cx, cw)).reshape(d, m, n)
          state["gemm_outs"] = gemm_outs
        state["ref"], state["label"], state["gemm_err"] = stream_reference(
            xs, ws, gemm_outs=gemm_outs)
      return state["ref"], state["label"]

    def check_rs(out, apply_rule=True):
      ref, label = oracle()
      err = max_rel_error(_to_numpy(out).reshape(d, m // d, n), ref)
      return _check_block(err, label, state.get("seq_err"), apply_rule)

    def check_gemm(out):
      del out  # checked inside oracle() on the same inputs
      _, label = oracle()
      return _check_block(state["gemm_err"], label, None, False)

    def check_comm(out):
      oracle()
      ys = state["gemm_outs"].astype(np.float64)
      ref = np.stack(np.split(ys.sum(axis=0), d, axis=0))
      err = max_rel_error(_to_numpy(out).reshape(d, m // d, n), ref)
      return _check_block(err, "numpy float64 sum of the bf16 GEMM outputs",
                          None, False)

    def check_seq(out):
      block = check_rs(out, apply_rule=False)
      state["seq_err"] = block["max_rel_error"]
      block["unfused_max_rel_error"] = block["max_rel_error"]
      block["ratio_to_unfused"] = 1.0
      return block

    flops = metrics.gemm_flops(m, k_shard, n)
    rs_bytes = metrics.reduce_scatter_bus_bytes(m, n, d, itemsize)
    estimates = metrics.roofline_estimates(
        m, k_shard, n, d, itemsize, **_peaks())

    def build_comm():
      y = gemm_fn(x, w)
      cy = gemm_fn(cx, cw)
      return smap(comm_body, (out_spec,)), (y,), (cy,)

    cands = [
        Candidate("gemm", lambda: (gemm_fn, (x, w), (cx, cw)), check_gemm,
                  flops, 0.0),
        Candidate("comm", build_comm, check_comm, 0.0, rs_bytes),
        Candidate("seq", lambda: (smap(seq_body, (x_spec, w_spec)), (x, w),
                                  (cx, cw)), check_seq, flops, rs_bytes),
    ]
    for impl in implementations:
      def build(impl=impl):
        body = functools.partial(pallas_rs.matmul_reduce_scatter,
                                 axis_name=AXIS, implementation=impl)
        return smap(body, (x_spec, w_spec)), (x, w), (cx, cw)
      cands.append(Candidate(impl, build, check_rs, flops, rs_bytes))
    if FLAGS.xla_peer:
      cands.append(_peer_candidate(mesh, x, w, cx, cw, out_spec, check_rs,
                                   flops, rs_bytes))

    by_impl = {}
    for cand in cands:
      rec = run_candidate(mode, shape, cand, num_devices=d, timer=timer)
      rec["estimates"] = estimates
      by_impl[cand.implementation] = rec
      records.append(rec)
    t_gemm, t_comm, t_seq = (_median(by_impl[b]) for b in BASELINES)
    for impl, rec in by_impl.items():
      if impl in BASELINES or rec["status"] != "ok":
        continue
      if None in (t_gemm, t_comm, t_seq):
        rec["notes"].append("overlap metrics need gemm, comm and seq timings")
        continue
      mets = metrics.overlap_metrics(t_gemm=t_gemm, t_comm=t_comm,
                                     t_seq=t_seq, t_fused=_median(rec))
      mets["t_ideal_us"] = mets.pop("t_ideal")
      rec["metrics"] = dict(mets, t_gemm_us=t_gemm, t_comm_us=t_comm,
                            t_seq_us=t_seq, t_fused_us=_median(rec))
    del state
  return records


def _peer_candidate(mesh, x, w, cx, cw, out_spec, check_rs, flops, rs_bytes):
  """XLA's windowed-einsum collective matmul: auto-sharded dot, P(axis, None).

  The flag is passed per compilation (compiler_options), so the baselines of
  the same process are unaffected; the compiled HLO is searched for
  "windowed_dot_general" and the record says whether XLA applied it.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  def build():
    fn = jax.jit(lambda a, b: a @ b,
                 out_shardings=NamedSharding(mesh, out_spec))
    lowered = fn.lower(x, w)
    try:
      compiled = lowered.compile(
          compiler_options={WINDOWED_EINSUM_OPTION: 0})
    except Exception as e:  # pylint: disable=broad-except
      # An XLA that does not know the option: a legal request it cannot do.
      raise NotImplementedError(
          f"compile with {WINDOWED_EINSUM_OPTION}=0 failed: {_status_of(e)}"
      ) from e
    return compiled, (x, w), (cx, cw)

  def probe(compiled):
    text = compiled.as_text() or ""
    found = "windowed_dot_general" in text
    notes = ([
        "windowed einsum runs kernels on several streams: the CUPTI sum "
        "overstates its time; compare timing.host_batch_us"] if found else [
            "compiled HLO has no windowed_dot_general: XLA did not apply the "
            "windowed einsum, this is a plain dot + reduce-scatter"])
    return {"windowed_dot_general": found,
            "compiler_options": {WINDOWED_EINSUM_OPTION: 0}, "notes": notes}

  return Candidate(PEER, build, check_rs, flops, rs_bytes, hlo_probe=probe)


# ---------------------------------------------------------------------------
# single_gpu: D = 1 kernel vs dot, and loopback.
# ---------------------------------------------------------------------------


def sweep_single_gpu(cases, timer) -> list[dict]:
  """(a) local_matmul vs XLA dot per per-device GEMM; (b) loopback vs XLA."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top

  mode = "single_gpu"
  records = []
  seen_local = set()
  for case in cases:
    dtype = jnp.dtype(case.dtype)
    itemsize = dtype.itemsize
    # (a) D = 1: the per-device GEMM of the shape at its own D.
    m, k_shard, n = case.m, case.k_shard, case.n
    if (m, k_shard, n, case.dtype) not in seen_local:
      seen_local.add((m, k_shard, n, case.dtype))
      records.extend(_local_records(mode, case, dtype, timer, fused))
    # (b) loopback at D = 8 and --num_devices.
    for d in sorted({8, FLAGS.num_devices or 8}):
      lcase = case if d == case.num_devices else case.with_num_devices(d)
      if lcase.k % d or lcase.m % d:
        logging.warning("%s: skip loopback D=%d (m, k not divisible)",
                        case.name, d)
        continue
      records.extend(_loopback_records(mode, lcase, dtype, itemsize, timer,
                                       fused))
  return records


def _local_records(mode, case, dtype, timer, fused):
  from pallas_rs import metrics  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  m, k_shard, n = case.m, case.k_shard, case.n
  shape = dict(shape_block(case), name=f"{case.name}_local",
               k=k_shard, num_devices=1, k_shard=k_shard, m_shard=m)
  gen = functools.partial(_random_global, m=m, k=k_shard, n=n, dtype=dtype,
                          mesh=None, x_spec=None, w_spec=None)
  x, w = gen(jax.random.key(FLAGS.seed))
  cx, cw = gen(jax.random.key(FLAGS.seed + 1))
  state = {}

  def check(out, apply_rule):
    if "ref" not in state:
      ref, label, _ = stream_reference(_to_numpy(cx)[None], _to_numpy(cw)[None])
      state["ref"], state["label"] = ref[0], label
    err = max_rel_error(_to_numpy(out), state["ref"])
    if not apply_rule:
      state["xla_err"] = err
    return _check_block(err, state["label"], state.get("xla_err"), apply_rule)

  xla_fn = jax.jit(lambda a, b: jnp.dot(
      a, b, preferred_element_type=jnp.float32).astype(dtype))
  local = fused.local_matmul
  flops = metrics.gemm_flops(m, k_shard, n)
  cands = [
      Candidate("local_xla", lambda: (xla_fn, (x, w), (cx, cw)),
                functools.partial(check, apply_rule=False), flops, 0.0),
      Candidate("local_fused", lambda: (jax.jit(local), (x, w), (cx, cw)),
                functools.partial(check, apply_rule=True), flops, 0.0),
  ]
  recs = [run_candidate(mode, shape, c, num_devices=1, timer=timer)
          for c in cands]
  t_xla, t_fused = _median(recs[0]), _median(recs[1])
  if t_xla and t_fused:
    recs[1]["metrics"] = {"fused_over_xla": t_fused / t_xla,
                          "t_xla_us": t_xla, "t_fused_us": t_fused}
  peak_flops = _peaks()["peak_flops"]
  est = metrics.estimate_t_gemm(m, k_shard, n, peak_flops=peak_flops)
  for r in recs:
    r["estimates"] = {"label": metrics.ESTIMATE_LABEL,
                      "peak_flops": peak_flops, "t_gemm_us": est * 1e6}
  return recs


def _loopback_records(mode, case, dtype, itemsize, timer, fused):
  from pallas_rs import metrics  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  d, m, k_shard, n = case.num_devices, case.m, case.k_shard, case.n
  shape = dict(shape_block(case), name=f"{case.name}_loopback")

  def gen(key):
    kx, kw = jax.random.split(key)
    xs = jax.random.normal(kx, (d, m, k_shard), jnp.float32)
    ws = jax.random.normal(kw, (d, k_shard, n), jnp.float32) / math.sqrt(case.k)
    return xs.astype(dtype), ws.astype(dtype)

  gen = jax.jit(gen)
  xs, ws = gen(jax.random.key(FLAGS.seed))
  cxs, cws = gen(jax.random.key(FLAGS.seed + 1))

  def stacked_dots(xs, ws):
    return jnp.einsum("dmk,dkn->dmn", xs, ws,
                      preferred_element_type=jnp.float32)

  from pallas_rs.reference import loopback_matmul_reduce_scatter as loopback_reference  # pylint: disable=g-import-not-at-top

  state = {}

  def oracle():
    if "ref" not in state:
      state["ref"], state["label"], _ = stream_reference(_to_numpy(cxs),
                                                         _to_numpy(cws))
    return state["ref"], state["label"]

  def check(out, apply_rule):
    ref, label = oracle()
    err = max_rel_error(_to_numpy(out), ref)
    if not apply_rule:
      state["xla_err"] = err
    return _check_block(err, label, state.get("xla_err"), apply_rule)

  def check_gemm(out):
    xs64 = _to_numpy(cxs).astype(np.float64)
    ws64 = _to_numpy(cws).astype(np.float64)
    if 2.0 * d * m * k_shard * n > FP64_REFERENCE_MAX_FLOPS:
      xs64, ws64 = xs64.astype(np.float32), ws64.astype(np.float32)
    ref = np.matmul(xs64, ws64)
    return _check_block(max_rel_error(_to_numpy(out), ref), "numpy matmul",
                        None, False)

  loop = fused.loopback_matmul_reduce_scatter
  flops = d * metrics.gemm_flops(m, k_shard, n)  # all D ranks on one GPU
  rs_bytes = d * metrics.reduce_scatter_bus_bytes(m, n, d, itemsize)
  gemm_only = jax.jit(lambda a, b: stacked_dots(a, b).astype(dtype))
  cands = [
      Candidate("loopback_gemm", lambda: (gemm_only, (xs, ws), (cxs, cws)),
                check_gemm, flops, 0.0),
      Candidate("loopback_reference",
                lambda: (jax.jit(loopback_reference), (xs, ws), (cxs, cws)),
                functools.partial(check, apply_rule=False), flops, rs_bytes),
      Candidate("loopback_fused", lambda: (jax.jit(loop), (xs, ws), (cxs, cws)),
                functools.partial(check, apply_rule=True), flops, rs_bytes),
  ]
  recs = [run_candidate(mode, shape, c, num_devices=1, timer=timer)
          for c in cands]
  t_gemm, t_ref, t_fused = (_median(r) for r in recs)
  if t_fused and t_ref:
    recs[2]["metrics"] = {
        "speedup_vs_reference": t_ref / t_fused,
        "fused_over_gemm_only": t_fused / t_gemm if t_gemm else None,
        "t_gemm_only_us": t_gemm, "t_reference_us": t_ref,
        "t_fused_us": t_fused}
  return recs


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  mode = configure_environment(FLAGS.mode)
  import jax  # pylint: disable=g-import-not-at-top,unused-import
  from pallas_rs import timing as timing_lib  # pylint: disable=g-import-not-at-top

  implementations = FLAGS.implementations
  if implementations is None:
    implementations = ["xla"] if mode == "smoke" else ["fused"]
  bad = [i for i in implementations if i not in OVERLAP_IMPLEMENTATIONS]
  if bad:
    raise app.UsageError(f"--implementations: {bad} not in "
                         f"{OVERLAP_IMPLEMENTATIONS}")
  if FLAGS.iterations < 1 or FLAGS.warmup < 0:
    raise app.UsageError(f"--iterations={FLAGS.iterations} must be >= 1 and "
                         f"--warmup={FLAGS.warmup} >= 0")
  timer = timing_lib.resolve_timer(FLAGS.timer)
  backend = jax.default_backend()
  if mode == "smoke":
    if backend != "cpu":
      logging.warning("smoke mode on backend=%s: still no performance claims",
                      backend)
    if FLAGS.timer == "auto":
      timer = "host_wall_clock"
  elif backend != "gpu":
    raise app.UsageError(f"--mode={mode} needs GPUs; backend is {backend}. "
                         "Use --mode=smoke on CPU.")
  if mode == "multi_gpu" and jax.device_count() < 2:
    raise app.UsageError(f"--mode=multi_gpu needs >= 2 GPUs, have "
                         f"{jax.device_count()}")
  if FLAGS.xla_peer and mode == "single_gpu":
    raise app.UsageError("--xla_peer needs a multi-device mode")

  cases = select_cases(mode)
  logging.info("mode=%s timer=%s shapes=%d implementations=%s", mode, timer,
               len(cases), implementations)
  start = time.perf_counter()
  if mode == "single_gpu":
    records = sweep_single_gpu(cases, timer)
  else:
    records = sweep_sharded(mode, cases, implementations, timer)
  records = [sanitize(r) for r in records]
  for r in records:
    validate_record(r)
  doc = {
      "schema_version": SCHEMA_VERSION,
      "environment": bench_env.environment_block(sys.argv),
      "flags": {name: sanitize(FLAGS[name].value) for name in _FLAG_NAMES},
      "mode": mode,
      "timer": timer,
      "performance_claims": timer == "cupti",
      "wall_s": time.perf_counter() - start,
      "records": records,
  }
  validate_results(doc)
  out = Path(FLAGS.out) if FLAGS.out else default_out_path(mode)
  bench_env.write_json(out, doc, allow_nan=False)
  print(format_table(records))
  print(LEGEND)
  if timer == "host_wall_clock":
    print(f"timer=host_wall_clock: {NO_CLAIMS}; E and speedup are not shown (noise on a "
          "CPU): this run checks that every path runs and is correct, not how fast it is")
  print(f"wrote {out}")
  failed = [r for r in records if r["status"].startswith("failed: ")
            or (r["check"] is not None and not r["check"]["passed"])]
  if failed:
    logging.error("%d record(s) failed or failed their check", len(failed))
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
