"""A per-call timeline of the fused kernel from Mosaic GPU's profiler (issue 19: where the
time of a small-M call goes; issue 17: when the comm CTAs run).

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/timeline.py \
      --names=llama70b_o_proj_m512,mixtral8x22b_w2_m512 --configs=table,p4

Per shape (at D = the visible GPUs; on one GPU the loopback at --num_devices virtual ranks,
one trace per call for all ranks, or with --alone one rank of a --num_devices-device call alone
on the GPU with the "comm" ablation: fused.rank_alone) and config (`config_variants.variant_config` names applied to
the config "fused" runs for the shape), runs the kernel under `fused.profile` (a Perfetto trace
of the named phases, body.py's per tile and comm.py's per step; kept per call as
call<NNN>-*-trace.json, one device's per call over NVLink: keep_call_traces) and summarizes
the last call's trace: per phase the count and the median / max duration over warpgroups, and
the call's landmarks: the first mainloop's start (launch to work), the last mainloop's end, the
last own epilogue's end (the call's end), so the tail (last mainloop end to call end) is the
exposed transfer and owner sum. The profiler needs shared memory, so the pipeline is shortened
until it fits (the config used is recorded); each event reads the clock: the durations are for
the phases' shares, not for speed claims (the harness's CUPTI times are). JSON (summaries,
configs, trace paths) under --out, a table last; the traces stay under --trace_dir for Perfetto.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
import statistics
import sys
import warnings

import bench_env  # experiments/ is sys.path[0] when run as a script.
from config_variants import tuned_config
from config_variants import variant_config
import flag_checks

from absl import app
from absl import flags

_NAMES = flags.DEFINE_list("names", ["llama70b_o_proj_m512", "mixtral8x22b_w2_m512"],
                           "Shapes (pallas_rs.bench.shapes), k_shard = k // D.")
_CONFIGS = flags.DEFINE_list("configs", ["table"], "Config variants per shape.")
_SPACE = flags.DEFINE_integer("space", 128, "Profiler events per warpgroup (fused.profile).")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 2, "One GPU: loopback virtual ranks (the "
                                    "protocol's timeline, not NVLink's).")
_ALONE = flags.DEFINE_bool("alone", False, "One GPU: one rank alone (fused.rank_alone, no "
                           "peers) instead of the loopback.")
_CALLS = flags.DEFINE_integer("calls", 3, "Calls per case; the last one's trace is summarized.")
_TRACE_DIR = flags.DEFINE_string("trace_dir", "", "Where the traces go; default "
                                 "experiments/out/timeline_traces (git-ignored).")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/timeline.json.")

# Events a compute warpgroup may record per tile (body.py: mainloop, own or remote epilogue,
# owner_wait: begin and end each, with margin), and per CTA besides.
EVENTS_PER_TILE, EVENTS_FIXED = 8, 16


def summarize(events: list[dict]) -> dict:
  """Phase statistics and landmarks of one trace (Mosaic GPU profiler events: name, ph "B"/"E",
  ts in us, pid the SM, tid the warpgroup). Times relative to the trace's first event."""
  if not events:
    raise ValueError("empty trace")
  t0 = min(e["ts"] for e in events)
  open_, spans = {}, []
  for e in sorted(events, key=lambda e: (e["tid"], e["ts"], e["ph"] == "B")):
    key = (e["tid"], e["name"])
    if e["ph"] == "B":
      open_.setdefault(key, []).append(e["ts"])
    elif open_.get(key):
      start = open_[key].pop()
      spans.append((e["name"], e["tid"], start - t0, e["ts"] - t0))
  phases = {}
  for name in sorted({s[0] for s in spans}):
    durs = [end - start for n, _, start, end in spans if n == name]
    phases[name] = {"count": len(durs), "median_us": statistics.median(durs),
                    "max_us": max(durs), "total_us": sum(durs)}

  def last_end(name):
    ends = [end for n, _, _, end in spans if n == name]
    return max(ends) if ends else None

  first_main = [start for n, _, start, _ in spans if n == "mainloop"]
  landmarks = {
      "first_mainloop_start_us": min(first_main) if first_main else None,
      "last_mainloop_end_us": last_end("mainloop"),
      "last_own_epilogue_end_us": last_end("own_epilogue"),
      "trace_end_us": max(e["ts"] for e in events) - t0,
  }
  if landmarks["last_mainloop_end_us"] is not None:
    landmarks["tail_us"] = landmarks["trace_end_us"] - landmarks["last_mainloop_end_us"]
  return {"phases": phases, "landmarks": landmarks, "warpgroups": len({e["tid"] for e in events}),
          "unclosed": sum(len(v) for v in open_.values())}


def fit_for_profile(cfg, *, space: int, num_devices: int, tiles_per_cta: int):
  """`cfg` with a pipeline short enough to leave the profiler its shared memory; raises
  app.UsageError if no depth fits or `space` cannot hold the events."""
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  need = EVENTS_PER_TILE * tiles_per_cta + EVENTS_FIXED
  if need > space:
    raise app.UsageError(f"--space={space} < {need} events ({tiles_per_cta} tiles per CTA): "
                         "more is undefined behaviour in the profiler")
  limit = config_lib.SMEM_LIMIT_BYTES - fused.profile_smem_bytes(space)
  for steps in range(cfg.max_concurrent_steps, 1, -1):
    cand = dataclasses.replace(cfg, max_concurrent_steps=steps)
    if cand.fits_smem(num_devices, limit=limit):
      return cand
  raise app.UsageError(f"{cfg} leaves no {fused.profile_smem_bytes(space)} B for the profiler")


def keep_call_traces(trace_dir: Path, call: int) -> list[Path]:
  """Renames the traces a call just dumped to `call<NNN>-<name>` and returns them.

  jax names a kernel's trace file once, when it lowers the kernel, and never overwrites it, so
  without this only the first call's trace would stay (at M = 512 over NVLink its owner waits
  ~200 us for the peer: BUILD_NOTES 2026-12-04), and over NVLink the devices' callbacks race
  for that one name, so one trace per call survives (jax warns for the other: silenced)."""
  kept = []
  for path in sorted(trace_dir.glob("*-trace.json")):
    if not path.name.startswith("call"):
      kept.append(path.rename(path.with_name(f"call{call:03d}-{path.name}")))
  return kept


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.shape_names("names", _NAMES.value)
  flag_checks.variant_names("configs", _CONFIGS.value)
  if _CALLS.value < 1:
    raise app.UsageError(f"--calls={_CALLS.value} must be >= 1")


def main(argv):
  del argv
  bench_env.configure_environment("auto")
  check_flags()
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import schedule  # pylint: disable=g-import-not-at-top

  bench_env.require_gpu("timeline.py", "profiles the Mosaic GPU kernel")
  gpus = jax.devices()
  nvlink = len(gpus) >= 2 and not _ALONE.value
  d = len(gpus) if nvlink else _NUM_DEVICES.value
  transport = "nvlink" if nvlink else "alone" if _ALONE.value else "loopback"
  if nvlink:
    mesh = jax.make_mesh((d,), ("tp",), devices=gpus)
    specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None),
                 check_vma=False)
  trace_root = Path(_TRACE_DIR.value) if _TRACE_DIR.value else (
      bench_env.default_out("timeline_traces"))
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("timeline.json")
  record = {"environment": bench_env.environment_block(sys.argv), "rows": []}
  for name in _NAMES.value:
    case = shapes.by_name(name)
    m, n, k_shard = case.m, case.n, case.k // d
    if nvlink:
      args = testing.generate(0, m, d * k_shard, n, num_devices=d,
                              shardings=testing.row_parallel_shardings(mesh, "tp"))
    elif _ALONE.value:
      args = testing.generate(0, m, k_shard, n)
    else:
      args = testing.stacked_inputs(0, d, m, k_shard, n)
    base = tuned_config(m=m, k_shard=k_shard, n=n, dtype=args[0].dtype, num_devices=d)
    for cname in _CONFIGS.value:
      cfg = variant_config(base, cname)
      tiles = schedule.total_tiles(m // d, n, cfg.cta_tile_m, cfg.cta_tile_n, d,
                                   cfg.chunk_group(m, d))
      # Loopback: the D ranks share the grid, num_sms // D CTAs each.
      ctas = (cfg.num_sms if transport != "loopback" else cfg.num_sms // d) - cfg.comm_ctas
      per_cta = -(-tiles // ctas)
      cfg = fit_for_profile(cfg, space=_SPACE.value, num_devices=d, tiles_per_cta=per_cta)
      trace_dir = trace_root / f"{name}_{cname}"
      trace_dir.mkdir(parents=True, exist_ok=True)
      with fused.profile(str(trace_dir), _SPACE.value), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to dump profile")  # keep_call_traces
        if nvlink:
          fn = jax.jit(jax.shard_map(functools.partial(
              fused.fused_matmul_reduce_scatter, axis_name="tp", num_devices=d, config=cfg),
              **specs))
        elif _ALONE.value:
          fn = jax.jit(functools.partial(fused.rank_alone, num_devices=d, config=cfg,
                                         ablate=("comm",)))
        else:
          fn = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
        for call in range(_CALLS.value):
          jax.block_until_ready(fn(*args))
          jax.effects_barrier()  # The trace is dumped by a host callback after the kernel.
          traces = keep_call_traces(trace_dir, call)
      row = {"name": name, "config_name": cname, "config": repr(cfg), "d": d,
             "transport": transport,
             "traces": [str(p) for p in traces],
             "summaries": [summarize(json.loads(p.read_text())["traceEvents"]) for p in traces]}
      record["rows"].append(row)
      bench_env.write_json(out, bench_env.sanitize(record))
      print(f"{name} {cname}: {len(traces)} traces", flush=True)

  print(f"\n{'shape':28} {'config':8} {'first main':>10} {'last main':>10} {'end':>8} "
        f"{'tail':>7}  phase medians (us)")
  for r in record["rows"]:
    for s in r["summaries"]:
      lm = s["landmarks"]
      fmt = lambda v: "-" if v is None else f"{v:.1f}"
      phases = " ".join(f"{k}={v['median_us']:.1f}" for k, v in s["phases"].items())
      print(f"{r['name']:28} {r['config_name']:8} {fmt(lm['first_mainloop_start_us']):>10} "
            f"{fmt(lm['last_mainloop_end_us']):>10} {fmt(lm['trace_end_us']):>8} "
            f"{fmt(lm.get('tail_us')):>7}  {phases}")
  print("wrote", out)


if __name__ == "__main__":
  app.run(main)
