"""The matmul + reduce-scatter benchmark as functions: shapes and settings in, records out.

`matmul_rs_bench.py` is the absl main around it (flags -> these arguments -> records -> table
and JSON). Nothing here reads a flag: every function takes the shapes, implementations,
devices and `Settings` (iterations, timer, check rule) it runs with, and returns records in
the results schema of `bench_records.validate_record`.

Per shape, a list of `Candidate`s (functions to time and check) is run together
(`run_candidates`: compile each, time them with `pallas_rs.bench.timing` in `Settings.rounds`
rounds, in turn within a round, check each output for fresh inputs against a numpy
reference), then the shape's records are finished together: the error rule (ratio to the
unfused candidate's error) and the overlap metrics need the baselines' records.
A shape's numpy reference is computed once, at its first check (memoized: no record depends on
the order in which candidates run).

Imports jax: import this module after `bench_env.configure_environment` (smoke mode sets
XLA_FLAGS before jax is first imported).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import math
from typing import Any

from absl import logging
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import pallas_rs
from pallas_rs.kernel import fused
from pallas_rs.tuning import metrics
from pallas_rs import reference
from pallas_rs.bench import alternating
from pallas_rs.bench import testing
from pallas_rs.bench import timing

from bench_env import NO_CLAIMS
from bench_records import AXIS
from bench_records import BASELINES
from bench_records import PEER
from bench_records import shape_block
from bench_records import WINDOWED_EINSUM_OPTION

# Above this many reference FLOPs the check uses float32 BLAS (summed in float64) instead of
# float64: minutes saved at the seed shapes, error of the reference ~1e-6 relative, far below
# bf16's 4e-3.
FP64_REFERENCE_MAX_FLOPS = 2e9
ROLES = ("baseline", "unfused", "judged")


@dataclasses.dataclass(frozen=True)
class Settings:
  """How every candidate is run.

  Attributes:
    timer: "cupti" or "host_wall_clock" (`pallas_rs.bench.timing`).
    iterations: timed calls per candidate.
    warmup: untimed calls after compilation.
    check: check every timed output, on inputs drawn with seed + 1.
    max_error_ratio: the rule: max rel error <= this times the unfused path's.
    keep_going: record unexpected exceptions as "failed: ..." instead of raising.
    seed: PRNG seed of the timing inputs.
    rounds: timing rounds per shape: each candidate's `iterations` split over them, the
      shape's candidates timed in turn within each round.
    interleave: with CUPTI, call by call in turn within a round (one CUPTI session per
      round); else each candidate's calls of a round back to back
      (`pallas_rs.bench.alternating`).
    peak_flops: FLOP/s of the roofline estimates.
    bus_bandwidth: reduce-scatter bus bandwidth (B/s) of the estimates.
  """
  timer: str
  iterations: int = timing.DEFAULT_ITERATIONS
  warmup: int = timing.DEFAULT_WARMUP
  check: bool = True
  max_error_ratio: float = 1.1
  keep_going: bool = False
  seed: int = 0
  rounds: int = 1
  interleave: bool = True
  peak_flops: float = metrics.MEASURED_PEAK_FLOPS_BF16
  bus_bandwidth: float = metrics.MEASURED_RS_BUS_BANDWIDTH


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One function to time and check.

  Attributes:
    implementation: the record's (bench_records.all_implementations()).
    build: () -> (fn, args, check_args); fn jitted or a Compiled, timed on args and checked
      on check_args.
    check: output for check_args -> (max_rel_error, reference label); None: not checked.
    flops, bytes: per device, for the throughput block.
    role: "judged" (the error rule applies: ratio to the shape's "unfused" candidate),
      "unfused" (the rule's baseline) or "baseline" (checked, not judged).
    hlo_probe: compiled -> a block for the record's "hlo" (its "notes" go to the record's).
  """
  implementation: str
  build: Callable[[], tuple[Any, tuple, tuple]]
  check: Callable[[Any], tuple[float, str]] | None
  flops: float
  bytes: float
  role: str = "baseline"
  hlo_probe: Callable[[Any], dict[str, Any]] | None = None

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"role={self.role!r} must be one of {ROLES}")


# ---------------------------------------------------------------------------
# Reference and checks.
# ---------------------------------------------------------------------------


def stream_reference(xs: np.ndarray, ws: np.ndarray, *,
                     gemm_outs: np.ndarray | None = None):
  """Numpy oracle over stacked inputs, one device's GEMM at a time.

  Args:
    xs: [D, m, k_shard]; ws: [D, k_shard, n] (any float dtype).
    gemm_outs: optional [D, m, n] per-device GEMM outputs to check on the way.

  Returns:
    (reference [D, m // D, n] float64, label, gemm max_rel_error or None). float64 products
    below FP64_REFERENCE_MAX_FLOPS (reference.numpy_reference's maths), float32 BLAS summed in
    float64 above (testing.stacked_reference's).
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
    part = np.asarray(xs[d]).astype(acc_dtype) @ np.asarray(ws[d]).astype(acc_dtype)
    if gemm_outs is not None:
      num = max(num, float(np.max(np.abs(gemm_outs[d].astype(np.float64) - part),
                                  initial=0.0)))
      den = max(den, float(np.max(np.abs(part), initial=0.0)))
    total += part
  gemm_err = None
  if gemm_outs is not None:
    gemm_err = num / den if den else (0.0 if num == 0 else math.inf)
  return np.stack(np.split(total, num_devices, axis=0)), label, gemm_err


def check_block(err: float, label: str, *, role: str, unfused_err: float | None,
                max_error_ratio: float) -> dict[str, Any]:
  """A record's "check": its error, and for a "judged" role the rule against `unfused_err`.

  A judged record without the unfused error (its candidate failed, was unavailable or
  unchecked) cannot be judged: "rule_applied" is False and it does not pass."""
  ratio, passed, applied = None, True, role == "judged"
  if role == "unfused":
    unfused_err, ratio = err, 1.0
  elif role == "judged" and unfused_err is not None:
    ratio = err / unfused_err if unfused_err > 0 else (0.0 if err == 0 else math.inf)
    passed = ratio <= max_error_ratio
  elif role == "judged":
    passed, applied = False, False
  elif role == "baseline":
    unfused_err = None
  passed = passed and not math.isnan(err)  # A NaN output fails whatever its role.
  return {"max_rel_error": err, "reference": label, "unfused_max_rel_error": unfused_err,
          "ratio_to_unfused": ratio,
          "rule": f"ratio_to_unfused <= {max_error_ratio}" if role == "judged" else None,
          "rule_applied": applied if role == "judged" else None, "passed": passed}


def _to_numpy(a) -> np.ndarray:
  return np.asarray(a).astype(np.float32)


def _status_of(e: BaseException) -> str:
  msg = " ".join(str(e).split())[:400]
  return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _median(record) -> float | None:
  if record is None or record["status"] != "ok":
    return None
  return record["timing"]["stats"]["median"]


# ---------------------------------------------------------------------------
# Running candidates.
# ---------------------------------------------------------------------------


def _new_record(mode: str, shape: dict[str, Any], cand: Candidate) -> dict[str, Any]:
  return {
      "mode": mode, "shape": shape, "implementation": cand.implementation,
      "status": "ok", "timer": None, "performance_claims": False,
      "timing": None, "check": None, "throughput": None, "metrics": None,
      "estimates": None, "notes": [],
  }


@dataclasses.dataclass
class _Run:
  """One candidate of a shape on its way through `run_candidates`."""
  cand: Candidate
  record: dict[str, Any]
  compiled: Any = None
  args: tuple = ()
  check_args: tuple = ()
  compile_s: float | None = None

  @property
  def ok(self) -> bool:
    return self.record["status"] == "ok"


def _fail(run: _Run, settings: Settings, e: Exception) -> None:
  """A NotImplementedError marks `run` unavailable, any other exception failed (with
  `settings.keep_going`; else it propagates)."""
  if isinstance(e, NotImplementedError):
    run.record["status"] = f"unavailable: {_status_of(e)}"
    logging.info("  %s unavailable: %s", run.cand.implementation, _status_of(e))
    return
  if not settings.keep_going:
    raise e
  run.record["status"] = f"failed: {_status_of(e)}"
  logging.exception("  %s failed (keep_going)", run.cand.implementation)  # (in an except)


def _guarded(run: _Run, settings: Settings, step: Callable[[], None]) -> None:
  """Runs one step of `run`; an exception goes to `_fail`."""
  try:
    step()
  except Exception as e:  # pylint: disable=broad-except
    _fail(run, settings, e)


def run_candidates(mode: str, shape: dict[str, Any], cands: Sequence[Candidate], *,
                   num_devices: int, settings: Settings) -> list[dict[str, Any]]:
  """Compiles every candidate, times them in `settings.rounds` rounds, in turn within a round
  (call by call with `settings.interleave`, so that a slow phase of the GPUs, which comes
  and goes over 0.1-0.4 s, falls on all of them alike), checks each output for fresh
  inputs, then applies the error rule (`check_block`: ratio to the shape's unfused
  candidate's error)."""
  runs = [_Run(c, _new_record(mode, shape, c)) for c in cands]
  for run in runs:
    logging.info("[%s] %s: %s", mode, shape["name"], run.cand.implementation)

    def compile_one(run=run):
      fn, run.args, run.check_args = run.cand.build()
      run.compiled, run.compile_s = timing.compile_function(fn, run.args)
      if run.cand.hlo_probe is not None:
        probe = run.cand.hlo_probe(run.compiled)
        run.record["hlo"] = probe
        run.record["notes"].extend(probe.get("notes", []))

    _guarded(run, settings, compile_one)
  timings = alternating.time_alternating(
      {i: (run.compiled, run.args) for i, run in enumerate(runs) if run.ok},
      iterations=settings.iterations, rounds=settings.rounds, warmup=settings.warmup,
      timer=settings.timer, num_devices=num_devices, interleave=settings.interleave,
      on_error=lambda i, e: _fail(runs[i], settings, e))
  for i, run in enumerate(runs):
    if run.ok:
      _guarded(run, settings, functools.partial(_finish, run, timings[i], settings))
  unfused = [r.record["check"] for r in runs if r.cand.role == "unfused"]
  unfused_err = unfused[0]["max_rel_error"] if unfused and unfused[0] else None
  for run in runs:
    r = run.record
    if r["check"] is not None:
      r["check"] = check_block(r["check"]["max_rel_error"], r["check"]["reference"],
                               role=run.cand.role, unfused_err=unfused_err,
                               max_error_ratio=settings.max_error_ratio)
  return [run.record for run in runs]


def _finish(run: _Run, t: timing.Timing, settings: Settings) -> None:
  """The record of a timed candidate: its timing `t`, throughput and (with
  `settings.check`) the output's error for the check inputs ("check" holds only
  max_rel_error and reference until `run_candidates` applies the rule)."""
  t.compile_s = run.compile_s
  record, cand = run.record, run.cand
  if settings.check and cand.check is not None:
    out = run.compiled(*run.check_args)
    err, label = cand.check(out)
    record["check"] = {"max_rel_error": err, "reference": label}
    del out
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
  logging.info("  %s: median %.2f us (%s)%s", cand.implementation, t.median_us, t.timer,
               "" if record["check"] is None else
               f", max rel err {record['check']['max_rel_error']:.3g}")


# ---------------------------------------------------------------------------
# multi_gpu / smoke: the real protocol under shard_map.
# ---------------------------------------------------------------------------


def devices_for(case, visible: int, override: int | None = None) -> int:
  """D to run `case` at: `override` if given, all visible devices for a "seed" shape (the
  seed sweep runs on whatever GPU count the machine has), else the case's own D."""
  if override:
    return override
  if "seed" in case.tags:
    return visible
  return case.num_devices


def cases_at(cases, visible: int, override: int | None = None, platform: str = "") -> list:
  """`cases` at the D of `devices_for`; ValueError if one needs more devices or divides badly."""
  out = []
  for case in cases:
    d = devices_for(case, visible, override)
    if d != case.num_devices:
      case = case.with_num_devices(d)
    if d > visible:
      raise ValueError(f"{case.name}: needs {d} devices, have {visible} ({platform})")
    if case.k % d or case.m % d:
      raise ValueError(f"{case.name}: k={case.k} and m={case.m} must be divisible by "
                       f"num_devices={d}")
    out.append(case)
  return out


def _smap(body, mesh, in_specs, out_specs=P(AXIS, None)):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False))


def _gemm(x, w, *, dtype):
  return reference.dot(x, w, dtype)


def _reduce_scatter(y):
  return lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)


def sharded_records(mode: str, case, implementations: Sequence[str], *, devices,
                    xla_peer: bool, settings: Settings) -> list[dict[str, Any]]:
  """gemm, comm, seq, each of `implementations` (and the XLA peer) for one shape, at
  D = case.num_devices on the first D of `devices`."""
  d, m, n, k_shard = case.num_devices, case.m, case.n, case.k_shard
  mesh = Mesh(np.array(devices[:d]), (AXIS,))
  dtype = jnp.dtype(case.dtype)
  shape = shape_block(case)
  x_spec, w_spec = P(None, AXIS), P(AXIS, None)
  gen = functools.partial(testing.generate, m=m, k=case.k, n=n, num_devices=d, dtype=dtype,
                          shardings=testing.row_parallel_shardings(mesh, AXIS))
  x, w = gen(settings.seed)
  cx, cw = gen(settings.seed + 1)
  gemm_fn = _smap(functools.partial(_gemm, dtype=dtype), mesh, (x_spec, w_spec))

  @functools.cache
  def oracle():
    """(reference, label, gemm error, gemm outputs [D, m, n]) of the check inputs, once."""
    xs, ws = testing.split_inputs(_to_numpy(cx), _to_numpy(cw), d)
    gemm_outs = _to_numpy(gemm_fn(cx, cw)).reshape(d, m, n)
    ref, label, gemm_err = stream_reference(xs, ws, gemm_outs=gemm_outs)
    return ref, label, gemm_err, gemm_outs

  def check_rs(out):
    ref, label, _, _ = oracle()
    return reference.max_rel_error(_to_numpy(out).reshape(d, m // d, n), ref), label

  def check_gemm(out):
    del out  # Checked inside oracle() on the same inputs.
    _, label, gemm_err, _ = oracle()
    return gemm_err, label

  def check_comm(out):
    ref = np.stack(np.split(oracle()[3].astype(np.float64).sum(axis=0), d, axis=0))
    return (reference.max_rel_error(_to_numpy(out).reshape(d, m // d, n), ref),
            "numpy float64 sum of the bf16 GEMM outputs")

  def build_comm():
    return _smap(_reduce_scatter, mesh, (P(AXIS, None),)), (gemm_fn(x, w),), (gemm_fn(cx, cw),)

  def build_op(impl):
    body = functools.partial(pallas_rs.matmul_reduce_scatter, axis_name=AXIS,
                             implementation=impl)
    return _smap(body, mesh, (x_spec, w_spec)), (x, w), (cx, cw)

  flops = metrics.gemm_flops(m, k_shard, n)
  rs_bytes = metrics.reduce_scatter_bus_bytes(m, n, d, dtype.itemsize)
  seq = functools.partial(reference.matmul_reduce_scatter, axis_name=AXIS)
  cands = [
      Candidate("gemm", lambda: (gemm_fn, (x, w), (cx, cw)), check_gemm, flops, 0.0),
      Candidate("comm", build_comm, check_comm, 0.0, rs_bytes),
      Candidate("seq", lambda: (_smap(seq, mesh, (x_spec, w_spec)), (x, w), (cx, cw)),
                check_rs, flops, rs_bytes, role="unfused"),
  ]
  cands += [Candidate(impl, functools.partial(build_op, impl), check_rs, flops, rs_bytes,
                      role="judged") for impl in implementations]
  if xla_peer:
    cands.append(_peer_candidate(mesh, (x, w), (cx, cw), check_rs, flops, rs_bytes))
  records = run_candidates(mode, shape, cands, num_devices=d, settings=settings)
  estimates = metrics.roofline_estimates(m, k_shard, n, d, dtype.itemsize,
                                         peak_flops=settings.peak_flops,
                                         bus_bandwidth=settings.bus_bandwidth)
  by_impl = {r["implementation"]: r for r in records}
  t_gemm, t_comm, t_seq = (_median(by_impl[b]) for b in BASELINES)
  for rec in records:
    rec["estimates"] = estimates
    if rec["implementation"] in BASELINES or rec["status"] != "ok":
      continue
    if None in (t_gemm, t_comm, t_seq):
      rec["notes"].append("overlap metrics need gemm, comm and seq timings")
      continue
    mets = metrics.overlap_metrics(t_gemm=t_gemm, t_comm=t_comm, t_seq=t_seq,
                                   t_fused=_median(rec))
    mets["t_ideal_us"] = mets.pop("t_ideal")
    # E's spread over the timing rounds (a bootstrap of rounds, all functions together).
    interval = metrics.overlap_interval(
        *(r["timing"]["times_us"] for r in (by_impl["gemm"], by_impl["comm"], rec)),
        rounds=settings.rounds)
    mets["overlap_efficiency_ci95"] = list(interval) if interval else None
    rec["metrics"] = dict(mets, t_gemm_us=t_gemm, t_comm_us=t_comm, t_seq_us=t_seq,
                          t_fused_us=_median(rec))
  return records


def _peer_candidate(mesh, args, check_args, check, flops, rs_bytes) -> Candidate:
  """XLA's windowed-einsum collective matmul: auto-sharded dot, P(axis, None).

  The option is passed per compilation (compiler_options), so the baselines of the same
  process are unaffected; the compiled HLO is searched for "windowed_dot_general" and the
  record says whether XLA applied it.
  """

  def build():
    fn = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P(AXIS, None)))
    lowered = fn.lower(*args)
    try:
      compiled = lowered.compile(compiler_options={WINDOWED_EINSUM_OPTION: 0})
    except Exception as e:  # pylint: disable=broad-except
      # An XLA that does not know the option: a legal request it cannot do.
      raise NotImplementedError(
          f"compile with {WINDOWED_EINSUM_OPTION}=0 failed: {_status_of(e)}") from e
    return compiled, args, check_args

  def probe(compiled):
    found = "windowed_dot_general" in (compiled.as_text() or "")
    notes = ([
        "windowed einsum runs kernels on several streams: the CUPTI sum "
        "overstates its time; compare timing.host_batch_us"] if found else [
            "compiled HLO has no windowed_dot_general: XLA did not apply the "
            "windowed einsum, this is a plain dot + reduce-scatter"])
    return {"windowed_dot_general": found,
            "compiler_options": {WINDOWED_EINSUM_OPTION: 0}, "notes": notes}

  return Candidate(PEER, build, check, flops, rs_bytes, role="judged", hlo_probe=probe)


# Called after each shape with that shape's records (progress lines, the JSON rewritten as the
# run goes, so that a run cut short keeps what it measured).
OnShape = Callable[[list[dict[str, Any]]], None]


def sweep_sharded(mode: str, cases, implementations: Sequence[str], *, devices,
                  xla_peer: bool, settings: Settings,
                  on_shape: OnShape | None = None) -> list[dict[str, Any]]:
  """`sharded_records` of every case (each at its own D, see `cases_at`); `on_shape` gets each
  case's records as soon as they are done."""
  records = []
  for case in cases:
    recs = sharded_records(mode, case, implementations, devices=devices, xla_peer=xla_peer,
                           settings=settings)
    records += recs
    if on_shape is not None:
      on_shape(recs)
  return records


# ---------------------------------------------------------------------------
# single_gpu: D = 1 kernel vs dot, and loopback.
# ---------------------------------------------------------------------------


def local_records(mode: str, case, settings: Settings) -> list[dict[str, Any]]:
  """D = 1: the shape's per-device GEMM [m, k_shard] x [k_shard, n], XLA dot vs the kernel."""
  m, k_shard, n = case.m, case.k_shard, case.n
  dtype = jnp.dtype(case.dtype)
  shape = dict(shape_block(case), name=f"{case.name}_local", k=k_shard, num_devices=1,
               k_shard=k_shard, m_shard=m)
  gen = functools.partial(testing.generate, m=m, k=k_shard, n=n, dtype=dtype)
  x, w = gen(settings.seed)
  cx, cw = gen(settings.seed + 1)

  @functools.cache
  def oracle():
    ref, label, _ = stream_reference(_to_numpy(cx)[None], _to_numpy(cw)[None])
    return ref[0], label

  def check(out):
    ref, label = oracle()
    return reference.max_rel_error(_to_numpy(out), ref), label

  xla_fn = jax.jit(functools.partial(_gemm, dtype=dtype))
  local = jax.jit(fused.local_matmul)
  flops = metrics.gemm_flops(m, k_shard, n)
  cands = [
      Candidate("local_xla", lambda: (xla_fn, (x, w), (cx, cw)), check, flops, 0.0,
                role="unfused"),
      Candidate("local_fused", lambda: (local, (x, w), (cx, cw)), check, flops, 0.0,
                role="judged"),
  ]
  recs = run_candidates(mode, shape, cands, num_devices=1, settings=settings)
  t_xla, t_fused = (_median(r) for r in recs)
  if t_xla and t_fused:
    recs[1]["metrics"] = {"fused_over_xla": t_fused / t_xla, "t_xla_us": t_xla,
                          "t_fused_us": t_fused}
  est = metrics.estimate_t_gemm(m, k_shard, n, peak_flops=settings.peak_flops)
  for r in recs:
    r["estimates"] = {"label": metrics.ESTIMATE_LABEL, "peak_flops": settings.peak_flops,
                      "t_gemm_us": est * 1e6}
  return recs


def _stacked_dots(xs, ws, *, dtype):
  return jax.vmap(functools.partial(reference.dot, out_dtype=dtype))(xs, ws)


def loopback_records(mode: str, case, settings: Settings) -> list[dict[str, Any]]:
  """D virtual ranks on one GPU: stacked dots, the unfused path emulated, the fused kernel."""
  d, m, k_shard, n = case.num_devices, case.m, case.k_shard, case.n
  dtype = jnp.dtype(case.dtype)
  shape = dict(shape_block(case), name=f"{case.name}_loopback")
  xs, ws = testing.stacked_inputs(settings.seed, d, m, k_shard, n, dtype)
  cxs, cws = testing.stacked_inputs(settings.seed + 1, d, m, k_shard, n, dtype)

  @functools.cache
  def oracle():
    ref, label, _ = stream_reference(_to_numpy(cxs), _to_numpy(cws))
    return ref, label

  def check(out):
    ref, label = oracle()
    return reference.max_rel_error(_to_numpy(out), ref), label

  def check_gemm(out):
    acc = np.float64 if 2.0 * d * m * k_shard * n <= FP64_REFERENCE_MAX_FLOPS else np.float32
    ref = np.matmul(_to_numpy(cxs).astype(acc), _to_numpy(cws).astype(acc))
    return reference.max_rel_error(_to_numpy(out), ref), "numpy matmul"

  flops = d * metrics.gemm_flops(m, k_shard, n)  # All D ranks on one GPU.
  rs_bytes = d * metrics.reduce_scatter_bus_bytes(m, n, d, dtype.itemsize)
  fns = {"loopback_gemm": jax.jit(functools.partial(_stacked_dots, dtype=dtype)),
         "loopback_reference": jax.jit(reference.loopback_matmul_reduce_scatter),
         "loopback_fused": jax.jit(fused.loopback_matmul_reduce_scatter)}
  build = lambda name: (fns[name], (xs, ws), (cxs, cws))
  cands = [
      Candidate("loopback_gemm", functools.partial(build, "loopback_gemm"), check_gemm,
                flops, 0.0),
      Candidate("loopback_reference", functools.partial(build, "loopback_reference"), check,
                flops, rs_bytes, role="unfused"),
      Candidate("loopback_fused", functools.partial(build, "loopback_fused"), check, flops,
                rs_bytes, role="judged"),
  ]
  recs = run_candidates(mode, shape, cands, num_devices=1, settings=settings)
  t_gemm, t_ref, t_fused = (_median(r) for r in recs)
  if t_fused and t_ref:
    recs[2]["metrics"] = {
        "speedup_vs_reference": t_ref / t_fused,
        "fused_over_gemm_only": t_fused / t_gemm if t_gemm else None,
        "t_gemm_only_us": t_gemm, "t_reference_us": t_ref, "t_fused_us": t_fused}
  return recs


def sweep_single_gpu(cases, *, loopback_devices: Sequence[int], settings: Settings,
                     on_shape: OnShape | None = None) -> list[dict[str, Any]]:
  """Per case: `local_records` (once per distinct per-device GEMM), then `loopback_records`
  at each D of `loopback_devices` that divides m and k; `on_shape` gets each case's records as
  soon as they are done."""
  mode = "single_gpu"
  records = []
  seen_local = set()
  for case in cases:
    recs = []
    if (case.m, case.k_shard, case.n, case.dtype) not in seen_local:
      seen_local.add((case.m, case.k_shard, case.n, case.dtype))
      recs += local_records(mode, case, settings)
    for d in loopback_devices:
      lcase = case if d == case.num_devices else case.with_num_devices(d)
      if lcase.k % d or lcase.m % d:
        logging.warning("%s: skip loopback D=%d (m, k not divisible)", case.name, d)
        continue
      recs += loopback_records(mode, lcase, settings)
    records += recs
    if on_shape is not None:
      on_shape(recs)
  return records
