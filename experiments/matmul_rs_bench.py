r"""Benchmark of matmul + reduce-scatter: fused kernel vs XLA baselines.

Modes (`--mode`):
  multi_gpu   the real protocol on D visible GPUs (one process, shard_map).
              Per shape: T_gemm (jnp.dot alone), T_comm (psum_scatter of an
              [m, n] array alone), T_seq (dot then psum_scatter, one jit), then
              each of `--implementations` (fused, xla, auto) and, with
              `--xla_peer`, XLA's windowed-einsum collective matmul.
  single_gpu  one GPU: (a) D = 1, `pallas_rs.kernel.fused.local_matmul` vs XLA's dot
              on each shape's per-device GEMM [m, k/D] x [k/D, n]; (b) loopback:
              `pallas_rs.kernel.fused.loopback_matmul_reduce_scatter` (D virtual ranks
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

Output: a JSON file (`--out`; default experiments/out/<mode>_<UTC stamp>.json, git-ignored,
smoke runs included) with an environment block and one record per (shape, implementation, mode);
see `bench_records.validate_record`. A short table is printed at the end.

This file is flags -> arguments -> `harness` (the sweeps, as functions) -> the
table and the JSON (`bench_records`, `bench_env`).

  python experiments/matmul_rs_bench.py --mode=smoke
  python experiments/matmul_rs_bench.py --mode=multi_gpu --tags=seed --xla_peer
  python experiments/matmul_rs_bench.py --mode=single_gpu --tags=seed
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
import sys
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent
for _path in (_REPO, _HERE):
  if str(_path) not in sys.path:
    sys.path.insert(0, str(_path))

# pylint: disable=g-import-not-at-top,wrong-import-position
import bench_env
from bench_env import configure_environment  # also used by the tests
from bench_env import MODES
from bench_env import NO_CLAIMS
from bench_env import sanitize
from bench_env import SMOKE_DEVICES
from bench_records import default_out_path
from bench_records import format_table
from bench_records import LEGEND
from bench_records import progress_line
from bench_records import SCHEMA_VERSION
from bench_records import TIMERS
from bench_records import validate_record
from bench_records import validate_results
from bench_records import WINDOWED_EINSUM_OPTION
import flag_checks
import gpu_clocks
# pylint: enable=g-import-not-at-top,wrong-import-position

# No jax (nor pallas_rs or harness, which import jax) at module level: XLA_FLAGS (smoke's
# forced host devices) must be set before jax is first imported, which
# `configure_environment` does in main().

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
                  "Among pallas_rs.api.IMPLEMENTATIONS; default 'xla' in smoke "
                  "mode, 'fused' otherwise. Baselines are always timed.")
flags.DEFINE_integer("iterations", 200, "Timed iterations per function.")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_integer("rounds", None, "Timing rounds per shape: --iterations split over "
                     "them, the shape's functions timed in turn within each (so that a slow "
                     "phase of the GPUs falls on all alike); default 10 on GPU, 1 otherwise.")
flag_checks.define_interleave(__name__)
flags.DEFINE_enum("timer", "auto", TIMERS, "auto: cupti on GPU, host wall "
                  "clock on CPU.")
flags.DEFINE_string("out", "", "JSON output path; default "
                    "experiments/out/<mode>_<UTC stamp>.json (git-ignored; e.g. "
                    "experiments/out/smoke_20261130-120000.json for --mode=smoke).")
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
                   "estimates; default pallas_rs.tuning.metrics."
                   "MEASURED_PEAK_FLOPS_BF16 (measured bf16 dense).")
flags.DEFINE_float("bus_bandwidth", None, "Reduce-scatter bus bandwidth (B/s) "
                   "for the estimates; default pallas_rs.tuning.metrics."
                   "MEASURED_RS_BUS_BANDWIDTH (measured NCCL busbw).")
_FLAG_NAMES = ("mode", "tags", "names", "m", "n", "k", "dtype", "num_devices",
               "implementations", "iterations", "warmup", "timer", "out",
               "check", "max_error_ratio", "xla_peer", "keep_going", "seed",
               "peak_flops", "bus_bandwidth")


def select_cases(mode: str) -> list[Any]:
  """The shapes to run, from --m/--n/--k or --names/--tags (mode default)."""
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
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


# Rounds of a GPU run: 200 iterations as 10 x 20 (a slow phase of the H200s lasts 0.1-0.4 s,
# 20-80 iterations of a 5 ms step; two copies of one GEMM timed 1, 4 and 10 rounds: BUILD_NOTES,
# seventy-seventh session).
DEFAULT_GPU_ROUNDS = 10


def settings_from_flags(timer: str):
  """harness.Settings of this run."""
  import harness  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import metrics  # pylint: disable=g-import-not-at-top
  return harness.Settings(
      timer=timer, iterations=FLAGS.iterations, warmup=FLAGS.warmup, check=FLAGS.check,
      max_error_ratio=FLAGS.max_error_ratio, keep_going=FLAGS.keep_going, seed=FLAGS.seed,
      rounds=FLAGS.rounds or (min(DEFAULT_GPU_ROUNDS, FLAGS.iterations)
                              if timer == "cupti" else 1),
      interleave=FLAGS.interleave,
      peak_flops=FLAGS.peak_flops or metrics.MEASURED_PEAK_FLOPS_BF16,
      bus_bandwidth=FLAGS.bus_bandwidth or metrics.MEASURED_RS_BUS_BANDWIDTH)


def timing_summary(records) -> str:
  """How many timed records ran call by call (pallas_rs.bench.alternating), and why the
  others did not (the device output's tail filters absl's warnings)."""
  from pallas_rs.bench import alternating  # pylint: disable=g-import-not-at-top
  timed = [r["timing"] for r in records if r.get("timing")]
  interleaved = sum(alternating.INTERLEAVED_RULE in t["rule"] for t in timed)
  why = sorted({n for t in timed for n in t["notes"] if n.endswith(alternating.NOT_INTERLEAVED)})
  return (f"timed call by call: {interleaved} of {len(timed)} records"
          + "".join(f"\n  {n}" for n in why))


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  from pallas_rs import api  # pylint: disable=g-import-not-at-top
  flag_checks.shape_names("names", FLAGS.names)
  flag_checks.shape_tags("tags", FLAGS.tags)
  flag_checks.subset("implementations", FLAGS.implementations, api.IMPLEMENTATIONS)
  flag_checks.positive_ints("iterations", [FLAGS.iterations])
  flag_checks.non_negative_ints("warmup", [FLAGS.warmup])
  if FLAGS.rounds is not None and not 1 <= FLAGS.rounds <= FLAGS.iterations:
    raise app.UsageError(f"--rounds={FLAGS.rounds} must be in [1, --iterations="
                         f"{FLAGS.iterations}]")


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  mode = configure_environment(FLAGS.mode)
  check_flags()
  import jax  # pylint: disable=g-import-not-at-top
  import harness  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top

  implementations = FLAGS.implementations
  if implementations is None:
    implementations = ["xla"] if mode == "smoke" else ["fused"]
  timer = timing.resolve_timer(FLAGS.timer)
  backend = jax.default_backend()
  if mode == "smoke":
    if backend != "cpu":
      logging.warning("smoke mode on backend=%s: still no performance claims", backend)
    if FLAGS.timer == "auto":
      timer = "host_wall_clock"
  elif backend != "gpu":
    raise app.UsageError(f"--mode={mode} needs GPUs; backend is {backend}. "
                         "Use --mode=smoke on CPU.")
  if mode == "multi_gpu" and jax.device_count() < 2:
    raise app.UsageError(f"--mode=multi_gpu needs >= 2 GPUs, have {jax.device_count()}")
  if FLAGS.xla_peer and mode == "single_gpu":
    raise app.UsageError("--xla_peer needs a multi-device mode")

  cases = select_cases(mode)
  settings = settings_from_flags(timer)
  logging.info("mode=%s timer=%s shapes=%d implementations=%s", mode, timer, len(cases),
               implementations)
  devices = jax.devices()
  if mode != "single_gpu":
    try:
      cases = harness.cases_at(cases, len(devices), FLAGS.num_devices, devices[0].platform)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  out = Path(FLAGS.out) if FLAGS.out else default_out_path(mode)
  print(f"{len(cases)} shape(s), mode={mode}; writing {out} after each shape", flush=True)
  start = time.perf_counter()
  records = []
  doc = {
      "schema_version": SCHEMA_VERSION,
      "environment": bench_env.environment_block(sys.argv),
      "flags": {name: sanitize(FLAGS[name].value) for name in _FLAG_NAMES},
      "mode": mode,
      "timer": timer,
      "performance_claims": timer == "cupti",
      "wall_s": 0.0,
      "complete": False,  # True once every shape ran: a run cut short keeps its shapes.
      "records": records,
  }

  # The SM clock each shape's timings ran at: long runs fall under the power cap (BUILD_NOTES,
  # eighty-fourth session). Not in smoke mode (no GPU claims).
  clocks = gpu_clocks.Sampler() if mode != "smoke" else None

  def on_shape(shape_records):
    """Progress line, then the JSON rewritten with every record so far."""
    gpu_clocks.attach(shape_records, clocks)
    shape_records = [sanitize(r) for r in shape_records]
    for r in shape_records:
      validate_record(r)
    records.extend(shape_records)
    doc["wall_s"] = time.perf_counter() - start
    validate_results(doc)
    bench_env.write_json(out, doc, allow_nan=False)
    print(progress_line(on_shape.done + 1, len(cases), shape_records, doc["wall_s"]),
          flush=True)
    on_shape.done += 1

  on_shape.done = 0
  if clocks is not None:
    clocks.start()
  try:
    if mode == "single_gpu":
      harness.sweep_single_gpu(cases, loopback_devices=sorted({8, FLAGS.num_devices or 8}),
                               settings=settings, on_shape=on_shape)
    else:
      harness.sweep_sharded(mode, cases, implementations, devices=devices,
                            xla_peer=FLAGS.xla_peer, settings=settings, on_shape=on_shape)
  finally:
    if clocks is not None:
      clocks.stop()
  doc["wall_s"] = time.perf_counter() - start
  doc["complete"] = True
  validate_results(doc)
  bench_env.write_json(out, doc, allow_nan=False)
  print(format_table(records))
  print(LEGEND)
  if doc["environment"].get("cupti_record_layout"):
    # "device_major": the timer paired each CUPTI record with its device (pallas_rs/bench/cupti.py).
    print(f"CUPTI record order across devices: {doc['environment']['cupti_record_layout']}")
  if timer == "cupti":
    print(timing_summary(records))
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
