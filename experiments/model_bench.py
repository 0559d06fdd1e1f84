r"""Benchmark of one sequence-parallel Llama-style block (pallas_rs.model).

Times the block's forward pass and forward+backward (loss = mean square of the
output; gradients of all parameters and of the input) for each of
`--implementations` ("xla", "fused", "auto"; the row-parallel o_proj/down_proj
via `pallas_rs.matmul_reduce_scatter`, the column-parallel QKV/gate_up via
`pallas_rs.all_gather_matmul`), plus "no_comm": the same block with every collective
replaced by a local op of the same shapes and the same matmuls forward and backward
(experiments/no_comm.py; numerically meaningless). With --per_layer, also
"no_comm_<layer>" for each of qkv, o_proj, gate_up, down_proj: the XLA block with only that
layer's collectives removed. forward_backward is value_and_grad of the per-device loss
(no_comm.block_functions: per-device gradients, so that the four layers' collectives are the
only ones in every program).

Figures per (model, m, D, pass, implementation):
  step_us            the step time (see "Which time" below).
  exposed_comm_us    T(impl) - T(no_comm): communication the block still
                     waits for (for "xla": the baseline's exposed
                     communication); exposed_comm_share = that / T(impl).
  exposed_comm_by_layer_us  ("xla", --per_layer) T(xla) - T(no_comm_<layer>):
                     which projection's communication is exposed.
  speedup_vs_xla     T(xla) / T(impl), end to end for the block.
Which time: on GPU, `host_batch_us` of `pallas_rs.bench.timing.time_function`
(wall clock of back-to-back iterations / iterations): overlapping streams are
counted once, which is what "exposed" needs; the CUPTI step time (per-kernel
sums, overstated when NCCL overlaps compute on another stream) is recorded too
(`timing`). On CPU, the median host wall clock per call: NO PERFORMANCE CLAIMS.

Modes (`--mode`):
  smoke       CPU, 8 forced host devices, tiny widths; checks that every
              implementation runs and agrees with "xla". No performance claims.
  multi_gpu   D = --num_devices (default: all visible) GPUs, real widths.
  single_gpu  one GPU, D = 1 mesh holding ONE device's share of a D-way
              (--num_devices, default 8) block: heads/D, kv_heads/D, ffn/D,
              all M tokens; no collectives (the compute floor per device).

An implementation that raises NotImplementedError is recorded as
"unavailable: <reason>" (never timed); what "auto" resolved to for each of the
four matmuls is in the record's `resolved` block.

Each timed implementation's output (and, for forward_backward, loss and
gradients) is compared with "xla" on the same inputs: `check.max_rel_error`,
normwise max over all outputs; passes at 3e-2 (forward) / 6e-2 (gradients), a
sanity bound for bf16 (a few roundings of u = 2^-8 per layer), not a
numerics claim.

  python experiments/model_bench.py --mode=smoke
  NCCL_NVLS_ENABLE=0 python experiments/model_bench.py --mode=multi_gpu \
      --model=llama70b --m=2048,8192 --iterations=50
  python experiments/model_bench.py --mode=single_gpu --model=mixtral8x22b

The environment and JSON helpers are shared with experiments/matmul_rs_bench.py
through experiments/bench_env.py (which defines no flags). On CPU the smoke numbers are host
wall clock: no performance claims.
"""
from __future__ import annotations

from collections.abc import Sequence
import datetime
import functools
from pathlib import Path
import sys
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import numpy as np

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):
  if str(_path) not in sys.path:
    sys.path.insert(0, str(_path))

import bench_env  # pylint: disable=g-import-not-at-top,wrong-import-position
from bench_env import fmt  # pylint: disable=g-import-not-at-top,wrong-import-position
import flag_checks  # pylint: disable=g-import-not-at-top,wrong-import-position

# No jax at module level: smoke mode's XLA_FLAGS must be set first.

AXIS = "tp"
MODES = ("smoke", "single_gpu", "multi_gpu")
NO_COMM = "no_comm"
PASSES = ("forward", "forward_backward")
LAYERS = ("qkv", "o_proj", "gate_up", "down_proj")  # pallas_rs.model.LAYERS (no jax import here)
# Widths of the seed models (docs/design.md section 2); Mixtral: one dense expert stands in for the MoE.
MODELS = {
    "llama70b": dict(hidden=8192, heads=64, kv_heads=8, head_dim=128,
                     ffn=28672),
    "mixtral8x22b": dict(hidden=6144, heads=48, kv_heads=8, head_dim=128,
                         ffn=16384),
}
SMOKE_DIMS = dict(hidden=256, heads=16, kv_heads=8, head_dim=16, ffn=512)
SMOKE_MS = (64, 256)
GPU_MS = (2048, 8192)
CHECK_TOL = {"forward": 3e-2, "forward_backward": 6e-2}
SMOKE_ITERATIONS = 5

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "smoke", MODES, "What to run; see the module doc.")
flags.DEFINE_enum("model", "llama70b", tuple(MODELS), "Model widths "
                  "(smoke mode uses tiny widths whatever this says).")
flags.DEFINE_list("m", None, f"Global token counts M; default {GPU_MS} on "
                  f"GPU, {SMOKE_MS} in smoke mode.")
flags.DEFINE_integer("num_devices", None, "D. multi_gpu: default all visible "
                     "GPUs; smoke: default 8; single_gpu: the D whose "
                     "per-device share is run (default 8).")
flags.DEFINE_list("implementations", "xla,fused,auto",
                  "Among pallas_rs.api.IMPLEMENTATIONS; xla and no_comm always run.")
flags.DEFINE_list("passes", ",".join(PASSES), f"Among {PASSES}.")
flags.DEFINE_integer("iterations", 50, "Timed iterations (smoke: "
                     f"{SMOKE_ITERATIONS} unless given).")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_enum("timer", "auto", ("auto", "cupti", "host_wall_clock"),
                  "auto: cupti on GPU, host wall clock on CPU.")
flags.DEFINE_enum("attention", "xla", ("xla", "cudnn"), "jax.nn."
                  "dot_product_attention implementation (cudnn: GPU only).")
flags.DEFINE_string("out", "", "JSON output path; default experiments/out/"
                    "model_<mode>_<UTC date>.json (git-ignored).")
flags.DEFINE_integer("seed", 0, "PRNG seed.")
flags.DEFINE_bool("keep_going", False, "Record unexpected exceptions as "
                  "'failed: ...' and continue (exit code 1).")
flags.DEFINE_bool("per_layer", False, "Also time the XLA block with one layer's collectives "
                  "removed at a time (no_comm_<layer>): per-layer exposed communication.")


def _dims(mode: str, num_devices: int) -> dict[str, int]:
  dims = dict(SMOKE_DIMS if mode == "smoke" else MODELS[FLAGS.model])
  if mode == "single_gpu":  # One device's share of a num_devices-way block.
    for key in ("heads", "kv_heads", "ffn"):
      dims[key] //= num_devices
  return dims


def _resolved(dims, m: int, d: int, implementation: str) -> dict[str, str]:
  """What each matmul of the block runs for `implementation` (before tracing)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import gate  # pylint: disable=g-import-not-at-top
  if implementation.startswith(NO_COMM):
    return {}
  hq, hkv = dims["heads"] // d, dims["kv_heads"] // d
  hidden, hd, f_shard = dims["hidden"], dims["head_dim"], dims["ffn"] // d
  ag_impl = "xla" if implementation == "xla" else "auto"
  out = {}
  for name, n in (("qkv", (hq + 2 * hkv) * hd), ("gate_up", 2 * f_shard)):
    try:
      decision = gate.decide("ag_matmul", m=m, k_shard=hidden, n=n, dtype=jnp.bfloat16,
                             num_devices=d, implementation=ag_impl)
      out[name] = _described(decision)
    except NotImplementedError as e:
      out[name] = f"unavailable ({e})"
  for name, k_shard in (("o_proj", hq * hd), ("down_proj", f_shard)):
    try:
      decision = gate.decide("matmul_rs", m=m, k_shard=k_shard, n=hidden, dtype=jnp.bfloat16,
                             num_devices=d, implementation=implementation)
      out[name] = _described(decision)
    except NotImplementedError as e:
      out[name] = f"unavailable ({e})"
  return out


def _described(decision) -> str:
  """"fused", or "xla (why)" where "auto" fell back."""
  fallback = decision.fallback
  return decision.implementation if fallback is None else f"{decision.implementation} ({fallback})"


def _without(variant: str) -> tuple[str, ...]:
  """The layers whose collectives `variant` removes."""
  import no_comm  # pylint: disable=g-import-not-at-top
  if variant == NO_COMM:
    return no_comm.LAYERS
  if variant.startswith(NO_COMM + "_"):
    return (variant[len(NO_COMM) + 1:],)
  return ()


def _functions(mesh, dims, variant):
  import no_comm  # pylint: disable=g-import-not-at-top
  without = _without(variant)
  return no_comm.block_functions(
      mesh, AXIS, without=without, heads=dims["heads"], kv_heads=dims["kv_heads"],
      implementation="xla" if without else variant,
      attention_implementation=FLAGS.attention)


def _inputs(mesh, dims, m: int, d: int, seed: int):
  """Params (model.init_params) and h [m, hidden] (testing.activations), bf16, generated in
  their shardings."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs import model  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                           model.param_specs(AXIS))
  init = functools.partial(model.init_params, num_devices=d,
                           dtype=jnp.bfloat16, **dims)
  params = jax.jit(init, out_shardings=shardings)(jax.random.key(seed))
  h = testing.activations(seed + 1, m, dims["hidden"],
                          sharding=NamedSharding(mesh, P(AXIS, None)))
  return params, h


def _step_us(record) -> float | None:
  if record["status"] != "ok":
    return None
  timing = record["timing"]
  return timing["host_batch_us"] or timing["stats"]["median"]


def check_against_xla(out, xla_out, pass_name: str) -> dict[str, Any]:
  """The record's "check": normwise max over all output leaves (a NaN in any leaf makes the
  error NaN, which fails), against CHECK_TOL[pass_name]."""
  import jax  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  err = float(np.max([reference.max_rel_error(a, b) for a, b in zip(
      jax.tree.leaves(out), jax.tree.leaves(xla_out))]))
  return {"max_rel_error": err, "reference": "xla block", "tolerance": CHECK_TOL[pass_name],
          "passed": bool(err <= CHECK_TOL[pass_name])}


def sweep(mode: str, implementations: Sequence[str],
          checkpoint=lambda records, done: None) -> list[dict[str, Any]]:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing as timing_lib  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  if mode == "single_gpu":
    share_of, d = FLAGS.num_devices or 8, 1
  else:
    d = FLAGS.num_devices or (8 if mode == "smoke" else len(devices))
    share_of = d
  if d > len(devices):
    raise app.UsageError(f"--num_devices={d} > {len(devices)} visible devices")
  mesh = Mesh(np.array(devices[:d]), (AXIS,))
  dims = _dims(mode, share_of)
  ms = [int(v) for v in FLAGS.m] if FLAGS.m else (
      SMOKE_MS if mode == "smoke" else GPU_MS)
  iterations = FLAGS.iterations
  if mode == "smoke" and not FLAGS["iterations"].present:
    iterations = SMOKE_ITERATIONS
  timer = timing_lib.resolve_timer(FLAGS.timer)
  claims = timer != "host_wall_clock"
  order = ["xla", NO_COMM] + [i for i in implementations if i != "xla"]
  if FLAGS.per_layer:
    order += [f"{NO_COMM}_{layer}" for layer in LAYERS]
  records = []
  for m in ms:
    if m % d:
      raise app.UsageError(f"m={m} must be divisible by num_devices={d}")
    params, h = _inputs(mesh, dims, m, d, FLAGS.seed)
    shape = {"model": "smoke" if mode == "smoke" else FLAGS.model, "m": m,
             "num_devices": d, "share_of_num_devices": share_of,
             "dtype": "bfloat16", "attention": FLAGS.attention, **dims}
    for pass_name in FLAGS.passes:
      outputs: dict[str, Any] = {}
      by_impl: dict[str, dict[str, Any]] = {}
      for impl in order:
        record = {"mode": mode, "shape": shape, "pass": pass_name,
                  "implementation": impl, "status": "ok", "timer": None,
                  "performance_claims": False, "timing": None, "check": None,
                  "metrics": None, "resolved": _resolved(dims, m, d, impl),
                  "notes": []}
        if impl.startswith(NO_COMM):
          record["notes"].append(f"collectives of {list(_without(impl))} replaced by local "
                                 "ops of the same shapes: numerically meaningless, timing only")
        try:
          fn = _functions(mesh, dims, impl)[pass_name]
          t = timing_lib.time_function(fn, (params, h), iterations=iterations,
                                       warmup=FLAGS.warmup, timer=timer,
                                       num_devices=d)
          outputs[impl] = jax.device_get(fn(params, h))
          record.update(timer=t.timer, performance_claims=claims,
                        timing=t.to_json())
          if not claims:
            record["notes"].append(bench_env.NO_CLAIMS)
        except NotImplementedError as e:
          record["status"] = f"unavailable: {e}"
        except Exception as e:  # pylint: disable=broad-except
          if not FLAGS.keep_going:
            raise
          logging.exception("%s m=%d %s", impl, m, pass_name)
          record["status"] = f"failed: {type(e).__name__}: {e}"
        if not impl.startswith(NO_COMM) and impl != "xla" and impl in outputs:
          record["check"] = check_against_xla(outputs[impl], outputs["xla"], pass_name)
        by_impl[impl] = record
        records.append(record)
      t_xla, t_local = _step_us(by_impl["xla"]), _step_us(by_impl[NO_COMM])
      for impl, record in by_impl.items():
        t_impl = _step_us(record)
        if impl.startswith(NO_COMM) or t_impl is None:
          continue
        exposed = None if t_local is None else t_impl - t_local
        record["metrics"] = {
            "step_us": t_impl,
            "step_time_source": ("host_batch_us" if record["timing"]
                                 ["host_batch_us"] else "median times_us"),
            "no_comm_step_us": t_local,
            "exposed_comm_us": exposed,
            "exposed_comm_share": None if exposed is None else exposed / t_impl,
            "speedup_vs_xla": None if t_xla is None else t_xla / t_impl,
        }
        if impl == "xla" and FLAGS.per_layer:
          record["metrics"]["exposed_comm_by_layer_us"] = {
              layer: (None if _step_us(by_impl[f"{NO_COMM}_{layer}"]) is None
                      else t_impl - _step_us(by_impl[f"{NO_COMM}_{layer}"]))
              for layer in LAYERS}
      checkpoint(records, f"m={m} {pass_name}")
  return records


def _status(record) -> str:
  """The record's status, "CHECK FAILED" where it ran but its check against "xla" failed."""
  chk = record["check"] or {}
  return "CHECK FAILED" if record["status"] == "ok" and chk.get("passed") is False else (
      record["status"])


def format_table(records) -> str:
  lines = [f"{'m':>6} {'D':>2} {'pass':<16} {'impl':<17} {'step_us':>10} "
           f"{'exposed%':>8} {'vs xla':>7} {'err':>8}  status"]
  for r in records:
    met, chk = r["metrics"] or {}, r["check"] or {}
    step = met.get("step_us") or (
        r["timing"]["stats"]["median"] if r["timing"] else None)
    share = met.get("exposed_comm_share")
    lines.append(
        f"{r['shape']['m']:>6} {r['shape']['num_devices']:>2} {r['pass']:<16} "
        f"{r['implementation']:<17} "
        f"{fmt(step, '.1f'):>10} "
        f"{fmt(None if share is None else 100 * share, '.1f'):>8} "
        f"{fmt(met.get('speedup_vs_xla'), '.3f'):>7} "
        f"{fmt(chk.get('max_rel_error'), '.1e'):>8}"
        f"  {_status(r)[:90]}")
  return "\n".join(lines)


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  from pallas_rs import api  # pylint: disable=g-import-not-at-top
  flag_checks.subset("implementations", FLAGS.implementations, api.IMPLEMENTATIONS)
  flag_checks.subset("passes", FLAGS.passes, PASSES)
  flag_checks.positive_ints("m", FLAGS.m)
  flag_checks.positive_ints("iterations", [FLAGS.iterations])
  flag_checks.non_negative_ints("warmup", [FLAGS.warmup])
  if FLAGS.num_devices is not None:
    flag_checks.positive_ints("num_devices", [FLAGS.num_devices])


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  mode = bench_env.configure_environment(FLAGS.mode)
  check_flags()
  implementations = list(FLAGS.implementations)
  import jax  # pylint: disable=g-import-not-at-top
  if mode == "smoke" and jax.default_backend() != "cpu":
    raise app.UsageError("smoke mode runs on CPU (JAX_PLATFORMS=cpu)")
  doc = {"schema_version": 1, "benchmark": "model_bench",
         "environment": bench_env.environment_block(sys.argv),
         "flags": {name: FLAGS[name].value for name in (
             "mode", "model", "m", "num_devices", "implementations", "passes",
             "iterations", "warmup", "timer", "attention", "seed", "per_layer")},
         "complete": False, "records": []}
  out = Path(FLAGS.out) if FLAGS.out else (
      bench_env.default_out(f"model_{mode}_"
                            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}.json"))
  start = time.perf_counter()

  def checkpoint(records, done: str) -> None:
    # After every (m, pass): a run cut short keeps what it measured.
    bench_env.write_json(out, bench_env.sanitize({**doc, "records": records}))
    print(f"{done}: {len(records)} records ({time.perf_counter() - start:.0f} s), "
          f"written to {out}", flush=True)

  records = sweep(mode, implementations, checkpoint)
  doc.update(complete=True, records=records)
  bench_env.write_json(out, bench_env.sanitize(doc))
  print(format_table(records))
  if mode == "smoke":
    print("host wall clock on CPU: NO PERFORMANCE CLAIMS")
  print(f"wrote {out}")
  failed = [r for r in records if r["status"].startswith("failed")]
  checks = [r for r in records if r["check"] and not r["check"]["passed"]]
  return 1 if failed or checks else 0


if __name__ == "__main__":
  app.run(main)
