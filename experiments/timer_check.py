"""How finely the benchmarks' timer compares two functions: one function compiled twice and
timed as two candidates A and B, where a perfect comparison gives B / A = 1.

  PYTHONPATH=. python experiments/timer_check.py                        # one GPU
  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/timer_check.py --num_devices=2 \
      --functions=gemm,seq

Per case of --names and function of --functions ("gemm": XLA's dot on each device, the
per-device GEMM m x k/D x n with D = --num_devices; "seq": that dot then `psum_scatter`
over the D GPUs, the unfused path; "fused": `pallas_rs.matmul_reduce_scatter` with
implementation="fused" over the D >= 2 GPUs, the table's config; "kernel": pallas_rs's kernel at
D = 1 on the same GEMM, `fused.local_matmul`, one GPU), --repeats times per method of --methods
(`pallas_rs.bench.alternating.time_alternating`, --iterations calls per candidate):
  block:       A's calls, then B's (one round, not interleaved);
  rounds:      --rounds rounds, each candidate's calls of a round back to back;
  interleaved: --rounds rounds, call by call in turn in one CUPTI session per round (on
               several GPUs a scalar psum, not counted, before each call).
Per repeat: median(B) / median(A), A's median, and (interleaved) the median of the
per-iteration ratios B_i / A_i. Then --trace_calls calls of A alone, each call's time kept:
how a call's time moves over a few seconds (in CUPTI sessions of at most
--trace_session_calls calls: a long session slows its calls, BUILD_NOTES 2026-12-05).
--ballast_mib holds device memory apart from the outputs throughout, to tell whether held
memory slows the calls wherever it is or only as the calls' own outputs. Each repeat of a
method, and the trace, records the SM clock, power and clock-lowering reasons it ran at
(`gpu_clocks`, nvidia-smi in the background): long sessions ran slower with the clock under the
power cap (BUILD_NOTES, eighty-fourth session). JSON under --out; a table last.
"""
from __future__ import annotations

import functools
from pathlib import Path
import statistics
import sys

import bench_env  # experiments/ is sys.path[0] when run as a script.
import config_variants
import flag_checks
import gpu_clocks

from absl import app
from absl import flags

FUNCTIONS = ("gemm", "seq", "fused", "kernel")
METHODS = ("block", "rounds", "interleaved")
_NAMES = flags.DEFINE_list("names", ["llama70b_o_proj_m8192", "mixtral8x22b_o_proj_m512"],
                           "Cases of pallas_rs.bench.shapes: global m, k, n.")
_FUNCTIONS = flags.DEFINE_list("functions", ["gemm"], f"Among {FUNCTIONS}.")
_METHODS = flags.DEFINE_list("methods", list(METHODS), f"Among {METHODS}.")
_DEVICES = flags.DEFINE_integer("num_devices", 1, "GPUs: the mesh of the functions.")
_REPEATS = flags.DEFINE_integer("repeats", 8, "Comparisons per method.")
_ITERS = flags.DEFINE_integer("iterations", 200, "Timed calls per candidate and comparison.")
_ROUNDS = flags.DEFINE_integer("rounds", 10, "Rounds of the rounds/interleaved methods.")
_TRACE = flags.DEFINE_integer("trace_calls", 2000, "Calls of A alone, each call's time kept "
                              "(0: none).")
_TRACE_SESSION = flags.DEFINE_integer(
    "trace_session_calls", 0, "The trace in CUPTI sessions of at most this many calls (0: as "
    "the benchmarks time, up to timing.MAX_OUTPUT_BYTES_IN_FLIGHT of held outputs per session). "
    "A session holds every call's outputs until it ends.")
_SESSION_LIMIT = flags.DEFINE_integer(
    "session_limit_mib", 0, "Held outputs a CUPTI session may reach, MiB per device, for every "
    "method and the trace (0: timing.MAX_OUTPUT_BYTES_IN_FLIGHT, what the benchmarks use); "
    "e.g. 16384, the limit before 2026-12-05, to see what held outputs cost.")
_BALLAST = flags.DEFINE_integer(
    "ballast_mib", 0, "Device memory, MiB per device, written and kept live before anything is "
    "compiled or timed, apart from the timed calls' outputs. If it slows the calls as held "
    "outputs do, where buffers sit matters; if not, the outputs' own pages do.")
_KERNEL_CONFIG = flags.DEFINE_string(
    "kernel_config", "table", "--functions=kernel: a config_variants name applied to the config "
    "the kernel runs for the shape at D = 1 ('table': as tuned), e.g. 'gn_g1' (another tile "
    "order).")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/"
                           "timer_check.json.")


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.shape_names("names", _NAMES.value)
  flag_checks.subset("functions", _FUNCTIONS.value, FUNCTIONS)
  flag_checks.subset("methods", _METHODS.value, METHODS)
  flag_checks.positive_ints("num_devices", [_DEVICES.value])
  flag_checks.positive_ints("repeats", [_REPEATS.value])
  flag_checks.positive_ints("rounds", [_ROUNDS.value])
  flag_checks.non_negative_ints("trace_calls", [_TRACE.value])
  flag_checks.non_negative_ints("trace_session_calls", [_TRACE_SESSION.value])
  flag_checks.non_negative_ints("session_limit_mib", [_SESSION_LIMIT.value])
  flag_checks.non_negative_ints("ballast_mib", [_BALLAST.value])
  flag_checks.variant_names("kernel_config", [_KERNEL_CONFIG.value])
  if not 1 <= _ROUNDS.value <= _ITERS.value:
    raise app.UsageError(f"--rounds={_ROUNDS.value} must be in [1, --iterations]")
  for function in ("seq", "fused"):
    if function in _FUNCTIONS.value and _DEVICES.value < 2:
      raise app.UsageError(f"--functions={function} needs --num_devices >= 2 (a reduce-scatter)")
  if "kernel" in _FUNCTIONS.value and _DEVICES.value != 1:
    raise app.UsageError("--functions=kernel runs on one GPU (fused.local_matmul): "
                         "--num_devices=1")


def allocate_ballast(mib: int, d: int) -> list:
  """`mib` MiB written on each of the first `d` devices, ready; the caller keeps them live."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if not mib:
    return []
  ballast = [jnp.ones((mib, 1 << 20), jnp.uint8, device=dev) for dev in jax.devices()[:d]]
  jax.block_until_ready(ballast)
  return ballast


def build(name: str, function: str, d: int):
  """(jitted function, args): `function` of case `name` on the first `d` GPUs."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import pallas_rs  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top

  case = shapes.by_name(name)
  if function == "kernel":
    cfg = config_variants.variant_config(
        config_variants.tuned_config(m=case.m, k_shard=case.k, n=case.n, dtype=case.dtype,
                                     num_devices=1), _KERNEL_CONFIG.value)
    # Unsharded arrays, as the harness gives local_matmul: Pallas refuses to slice a ref along
    # a mesh-sharded axis.
    return (jax.jit(functools.partial(fused.local_matmul, config=cfg)),
            testing.generate(0, case.m, case.k, case.n))

  mesh = jax.make_mesh((d,), ("tp",), devices=jax.devices()[:d])
  x, w = testing.generate(0, case.m, case.k, case.n, num_devices=d,
                          shardings=testing.row_parallel_shardings(mesh, "tp"))

  def body(xs, ws):
    if function == "fused":
      return pallas_rs.matmul_reduce_scatter(xs, ws, axis_name="tp", implementation="fused")
    y = reference.dot(xs, ws)
    if function == "seq":
      y = jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)
    return y

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                     out_specs=P("tp", None))
  return jax.jit(fn), (x, w)


def compare(name: str, function: str, d: int) -> dict:
  """The --repeats comparisons of --methods for one case and function, then the trace."""
  from pallas_rs.bench import alternating  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top

  fn, args = build(name, function, d)
  # Two executables of one program: B / A = 1 but for the timer.
  a, b = (timing.compile_function(fn, args)[0] for _ in range(2))
  row = {"name": name, "function": function, "num_devices": d, "methods": {}}
  if function == "kernel":
    row["kernel_config"] = _KERNEL_CONFIG.value
  for repeat in range(_REPEATS.value):
    for method in _METHODS.value:
      with gpu_clocks.sampled() as clocks:
        got = alternating.time_alternating(
            {"A": (a, args), "B": (b, args)}, iterations=_ITERS.value,
            rounds=1 if method == "block" else _ROUNDS.value, num_devices=d,
            interleave=method == "interleaved")
      ta, tb = got["A"], got["B"]
      entry = row["methods"].setdefault(method, {"ratio": [], "a_median_us": [],
                                                 "paired_ratio": [], "rules": [],
                                                 "clocks": []})
      entry["clocks"].append(clocks.result())
      entry["ratio"].append(tb.median_us / ta.median_us)
      entry["a_median_us"].append(ta.median_us)
      entry["paired_ratio"].append(statistics.median(
          y / x for x, y in zip(ta.times_us, tb.times_us)))
      if repeat == 0:
        entry["rules"] = [ta.rule] + ta.notes
        entry["first_times_us"] = {"A": ta.times_us, "B": tb.times_us}
  if _TRACE.value:
    row.update(trace(a, args, d))
  return row


def trace(compiled, args, d: int) -> dict:
  """--trace_calls calls of one executable, each call's time kept, in sessions of at most
  --trace_session_calls calls (0: `timing.time_function`'s own split)."""
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  total, per = _TRACE.value, _TRACE_SESSION.value or _TRACE.value
  times, rule = [], None
  with gpu_clocks.sampled() as clocks:
    for calls in timing.round_iterations(total, -(-total // per)):
      got = timing.time_function(compiled, args, iterations=calls, warmup=0, num_devices=d)
      times += got.times_us
      rule = rule or "; ".join([got.rule] + got.notes)
  # A 56 us GEMM's trace slowed in steps as one session went on, and the SM clock with it
  # (one H100, BUILD_NOTES eighty-second to eighty-fourth sessions): footprint and clock go with it.
  return {"trace_us": times, "trace_rule": rule,
          "trace_clocks": clocks.result(),
          "trace_session_calls": _TRACE_SESSION.value or None,
          "output_bytes_per_call": timing.output_bytes(compiled)}


def summary(row: dict) -> list[list[str]]:
  """Table rows: per method, B / A's mean and spread over the repeats, A's median."""
  fmt = bench_env.fmt
  out = []
  for method, e in row["methods"].items():
    dev = [abs(1 - r) for r in e["ratio"]]
    out.append([row["name"], row["function"], method, fmt(statistics.mean(e["ratio"]), ".4f"),
                fmt(statistics.pstdev(e["ratio"]), ".4f"), fmt(max(dev), ".4f"),
                fmt(statistics.mean(e["paired_ratio"]), ".4f"),
                fmt(statistics.mean(e["a_median_us"]), ".1f"),
                "; ".join(gpu_clocks.busy_mhz(c) for c in e["clocks"])])
  if "trace_us" in row:
    t = row["trace_us"]
    blocks = [statistics.mean(t[i:i + 50]) for i in range(0, len(t) - 49, 50)]
    out.append([row["name"], row["function"], f"trace {len(t)} calls", "", "", "",
                f"blocks of 50: {min(blocks):.1f}-{max(blocks):.1f} us",
                fmt(statistics.median(t), ".1f"), gpu_clocks.busy_mhz(row.get("trace_clocks"))])
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  bench_env.configure_environment("multi_gpu" if _DEVICES.value > 1 else "single_gpu")
  check_flags()
  import jax  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top

  bench_env.require_cupti("timer_check.py")
  if _SESSION_LIMIT.value:  # This process only: the script measures the limit's effect.
    timing.MAX_OUTPUT_BYTES_IN_FLIGHT = _SESSION_LIMIT.value << 20
  if len(jax.devices()) < _DEVICES.value:
    raise app.UsageError(f"--num_devices={_DEVICES.value}: {len(jax.devices())} visible")
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("timer_check.json")
  ballast = allocate_ballast(_BALLAST.value, _DEVICES.value)  # Live until main returns.
  record = {"environment": bench_env.environment_block(sys.argv),
            "session_limit_bytes": timing.MAX_OUTPUT_BYTES_IN_FLIGHT,
            "ballast_bytes_per_device": sum(b.nbytes for b in ballast) // _DEVICES.value,
            "rows": []}
  table = []
  for name in _NAMES.value:
    for function in _FUNCTIONS.value:
      row = compare(name, function, _DEVICES.value)
      record["rows"].append(row)
      bench_env.write_json(out, record)
      table += summary(row)
      print(f"{name} {function}: done", flush=True)
  del ballast
  print(f"\nwrote {out}\n")
  print("| case | function | method | B/A mean | sd | max abs(1 - B/A) | paired B/A | A us "
        "| SM MHz (busy median, per repeat) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for cells in table:
    print("| " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  app.run(main)
