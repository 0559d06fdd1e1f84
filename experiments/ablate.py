"""Where the fused kernel's time goes: the kernel with one stage left out at a time.

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/ablate.py --names=llama70b_o_proj_m512
  # The GEMM core alone against XLA's dot at small M, for several tile shapes (issue 19):
  ... ablate.py --names=llama70b_o_proj_m512,llama70b_o_proj_m512_proxy8 \
      --configs=table,t64x256_wm,t64x192_wm,t64x128 --ablations=fused,neither

Per shape (seed or proxy8 names) and config (--configs: variant names of
config_variants.variant_config applied to the config "fused" runs for the shape: the tuning
table's, else the default), times (CUPTI device time, median of --iterations, in --rounds
rounds that alternate the variants) the fused kernel
as is and with `ablate` = "comm" (peer tiles stored locally, no signals or waits), "reduce" (no
loads and adds of received partials), both ("neither": the GEMM core and its local epilogue),
or "no_add" ("comm" with the owner's partials loaded but not read into registers and added),
or "moves" / "moves_no_store" (no mainloop: with comm CTAs, their rate inside the kernel, GB/s
per comm CTA; without storing what they pulled), or "neither_no_store" ("neither" without the
epilogues' TMA stores);
plus XLA's dot alone (T_gemm) and dot + psum_scatter (T_seq).
Differences give the exposed cost of each stage (BUILD_NOTES "What to try first"). On several
GPUs this runs the NVLink path over all of them (D = GPU count); on one GPU the loopback at
--num_devices virtual ranks, where "communication" is a local copy, or with --alone one rank's
program of a --num_devices-device call on all of the GPU's SMs (`fused.rank_alone`: the
ablations without communication only; XLA's dot of that rank's GEMM as the baseline):

  ... ablate.py --alone --num_devices=8 --names=llama70b_o_proj_m512 --ablations=no_comm,neither

With --producer=swiglu the rank's x is computed in the same jit (for XLA's dot too), as in a
model, and the table lists each call's kernels: whether the fill of the kernel's semaphores
stays a kernel of its own there.

Only the unablated kernel's output is checked (the ablated ones are wrong by construction),
against the error rule (max relative error <= 1.1x the unfused path's; in loopback its
emulation summed in the order the config's numerics copies): exit code 1 if any breaks it.
"""
from __future__ import annotations

import functools
from pathlib import Path
import statistics
import sys

import bench_env  # experiments/ is sys.path[0] when run as a script.
from config_variants import tuned_config
from config_variants import variant_config
import flag_checks

from absl import app
from absl import flags

_NAMES = flags.DEFINE_list("names", ["llama70b_o_proj_m512", "mixtral8x22b_w2_m2048"],
                           "Seed shape names (pallas_rs.shapes).")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Loopback (one GPU): virtual ranks.")
_ALONE = flags.DEFINE_bool("alone", False, "One GPU: rank --rank of a --num_devices-device call "
                           "alone on the GPU (fused.rank_alone) instead of the loopback.")
_RANK = flags.DEFINE_integer("rank", 0, "--alone: which rank's program.")
_PRODUCER = flags.DEFINE_enum(
    "producer", "", ["", "swiglu"], "--alone: compute the kernel's x in the same jit, as a "
    "model does (swiglu: silu(a) * b, a SwiGLU feeding a down projection), XLA's dot too; "
    "the table then lists each call's kernels: whether XLA fused the semaphores' zero-fill "
    "with the producer.")
_ITERS = flags.DEFINE_integer("iterations", 100, "Timed iterations per variant.")
_TIMING = flag_checks.TimingFlags(__name__, "the variants of a shape")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/"
                           "ablate_<mode>.json (git-ignored).")
_CONFIGS = flags.DEFINE_list("configs", ["table"], "Config variants per shape "
                             "(config_variants.variant_config names; 'table' = as tuned).")
_UNVERIFIED = flags.DEFINE_bool("unverified", False, "NVLink: also run configs that "
                                "fused.nvlink_unverified refuses (they may stall: "
                                "run_multi_gpu.sh stall_ablate).")

VARIANTS = {"fused": (), "no_comm": ("comm",), "no_reduce": ("reduce",),
            "neither": ("comm", "reduce"), "no_add": ("comm", "owner_add"),
            "no_owner_wait": ("owner_wait",),
            # The data movement alone (no mainloop): with comm CTAs, their rate inside the
            # kernel (row "comm_gbps_per_cta"); "_no_store": a pulling CTA's loads alone.
            "moves": ("gemm",), "moves_no_store": ("gemm", "recv_store"),
            # "neither" without the epilogues' TMA stores (each sub-tile written to SMEM and
            # dropped): what the stores cost the GEMM core (BUILD_NOTES 2026-12-06, ninetieth).
            "neither_no_store": ("comm", "reduce", "store")}
_ABLATIONS = flags.DEFINE_list("ablations", ["fused", "no_comm", "no_reduce", "neither"],
                               f"Which of {list(VARIANTS)}.")


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.shape_names("names", _NAMES.value)
  flag_checks.variant_names("configs", _CONFIGS.value)
  flag_checks.subset("ablations", _ABLATIONS.value, VARIANTS)
  _TIMING.check()
  if _PRODUCER.value and not _ALONE.value:
    raise app.UsageError("--producer needs --alone")


def main(argv):
  del argv
  mode = bench_env.configure_environment("auto")
  check_flags()
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import model  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import alternating  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top

  bench_env.require_gpu("ablate.py", "times the fused Mosaic GPU kernel")
  gpus = jax.devices()
  nvlink = len(gpus) >= 2 and not _ALONE.value
  if _ALONE.value:
    peers = [label for label in _ABLATIONS.value if "comm" not in VARIANTS[label]]
    if peers:
      raise app.UsageError(f"--alone runs without peers: drop {peers} from --ablations")
  rows = []
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out(f"ablate_{mode}.json")
  environment = bench_env.environment_block(sys.argv)

  def save():
    bench_env.write_json(out, bench_env.sanitize(dict(environment=environment, rows=rows)))

  for name in _NAMES.value:
    case = shapes.by_name(name)
    d = len(gpus) if nvlink else _NUM_DEVICES.value
    m, n, k_shard = case.m, case.n, case.k // d
    transport = "nvlink" if nvlink else "alone" if _ALONE.value else "loopback"
    row = dict(name=name, d=d, transport=transport, times_us={})
    if transport == "alone":
      row["rank"] = _RANK.value
      args = testing.generate(0, m, k_shard, n)
      build = lambda ablate, cfg: jax.jit(functools.partial(
          fused.rank_alone, num_devices=d, rank=_RANK.value, ablate=ablate, config=cfg))
      baselines = {"xla_gemm": jax.jit(reference.dot)}
      if _PRODUCER.value:
        row["producer"] = _PRODUCER.value
        args = (args[0], testing.generate(1, m, k_shard, n)[0], args[1])
        # The block's own activation (pallas_rs.model), so the producer is the model's.
        act = lambda a, b: model.swiglu(a, b, a.dtype)
        build = lambda ablate, cfg, kernel=build: jax.jit(
            lambda a, b, w: kernel(ablate, cfg)(act(a, b), w))
        baselines = {"xla_gemm": jax.jit(lambda a, b, w: reference.dot(act(a, b), w))}
      check = None
    elif nvlink:
      mesh = jax.make_mesh((d,), ("tp",), devices=gpus[:d])
      specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                   out_specs=P("tp", None), check_vma=False)
      args = testing.generate(0, m, d * k_shard, n, num_devices=d,
                              shardings=testing.row_parallel_shardings(mesh, "tp"))
      ref = testing.stacked_reference(*testing.split_inputs(*args, d))
      build = lambda ablate, cfg: jax.jit(jax.shard_map(functools.partial(
          fused.fused_matmul_reduce_scatter, axis_name="tp", num_devices=d, ablate=ablate,
          config=cfg, unverified=_UNVERIFIED.value), **specs))
      baselines = {
          "xla_seq": jax.jit(jax.shard_map(functools.partial(
              reference.matmul_reduce_scatter, axis_name="tp"), **specs)),
          "xla_gemm": jax.jit(jax.shard_map(
              reference.dot, **dict(specs, out_specs=P(None, "tp")))),
      }
      check = lambda out: reference.max_rel_error(jax.device_get(out).reshape(d, m // d, n), ref)
    else:
      args = testing.stacked_inputs(0, d, m, k_shard, n)
      ref = testing.stacked_reference(*args)
      build = lambda ablate, cfg: jax.jit(functools.partial(
          fused.loopback_matmul_reduce_scatter, ablate=ablate, config=cfg))
      # Timed in source order; each kernel judged against the order its numerics copies.
      baselines = {"xla_seq": testing.loopback_unfused("source"),
                   "xla_gemm": jax.jit(jax.vmap(reference.dot))}
      check = lambda out: reference.max_rel_error(jax.device_get(out), ref)
    base = tuned_config(m=m, k_shard=k_shard, n=n, dtype=args[0].dtype, num_devices=d)
    fns, cfgs, row["configs"] = dict(baselines), {}, {}
    for cname in _CONFIGS.value:
      cfg = variant_config(base, cname, num_devices=d)
      try:  # The kernel's own check, as its entry point will run it.
        fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=args[0].dtype, num_devices=d,
                              config=cfg, loopback=transport == "loopback",
                              unverified=_UNVERIFIED.value, alone=transport == "alone")
      except NotImplementedError as e:
        row["configs"][cname] = f"unavailable: {e}"
        continue
      row["configs"][cname] = repr(cfg)
      for label in _ABLATIONS.value:
        key = label if cname == "table" else f"{cname}:{label}"
        fns[key], cfgs[key] = build(VARIANTS[label], cfg), cfg
    # Every variant compiled first, then timed in rounds, in turn within each (a slow phase of
    # the GPUs falls on all alike: BUILD_NOTES, seventy-seventh session).
    timings = alternating.time_alternating(
        {label: (timing.compile_function(fn, args)[0], args) for label, fn in fns.items()},
        iterations=_ITERS.value, num_devices=d if nvlink else 1,
        **_TIMING.kwargs(_ITERS.value))
    for label, t in timings.items():
      row["times_us"][label] = t.times_us
      row.setdefault("timer", t.timer)
      if t.kernels:  # per kernel of a call: what besides the Mosaic kernel each call launches
        row.setdefault("kernels", {})[label] = t.kernels
    unfused_errors = {}  # by the order of the unfused path's sum
    unfused_fn = lambda order: fns["xla_seq"] if order == "nccl" else testing.loopback_unfused(
        order)
    for label in fns:
      if label.endswith("fused"):  # every unablated kernel's output is judged by the rule
        row.setdefault("max_rel_error", {})[label] = err = check(fns[label](*args))
        order = testing.unfused_order(cfgs[label]) if transport == "loopback" else "nccl"
        if order not in unfused_errors:
          unfused_errors[order] = check(unfused_fn(order)(*args))
        row.setdefault("unfused_max_rel_error", {})[label] = unfused_errors[order]
        row.setdefault("rule_holds", {})[label] = bench_env.rule_holds(err, unfused_errors[order])
      cfg = cfgs.get(label)  # (None for XLA's baselines)
      if cfg is not None and label.rpartition(":")[2].startswith("moves") and cfg.comm_ctas:
        # The bytes one rank's comm CTAs move.
        moved = (d - 1) * (m // d) * n * cfg.partial_itemsize
        row.setdefault("comm_gbps_per_cta", {})[label] = (
            moved / (statistics.median(row["times_us"][label]) * 1e3) / cfg.comm_ctas)
    rows.append(row)
    med = {k: statistics.median(v) for k, v in row["times_us"].items()}
    print(name, {k: round(v, 1) for k, v in med.items()}, flush=True)
    if row.get("comm_gbps_per_cta"):
      print("  GB/s per comm CTA:", {k: round(v, 1) for k, v in row["comm_gbps_per_cta"].items()})
    save()  # After every shape: a run cut short keeps what it measured.

  # "kernel us": the Mosaic kernel's median alone; "other us": what else the call launches
  # (at D > 1 jax's zero-fill of the kernel's semaphores), both per device (CUPTI only).
  print(f"\n{'shape':32} {'D':>2} {'config':>10} {'variant':>10} {'us':>9} {'/ xla_gemm':>10} "
        f"{'kernel us':>9} {'other us':>8}")
  for r in rows:
    med = {k: statistics.median(v) for k, v in r["times_us"].items()}
    per_device = r["d"] if r["transport"] == "nvlink" else 1
    for label, t in med.items():
      cname, _, variant = label.rpartition(":")
      kernels = r.get("kernels", {}).get(label)
      split = (timing.kernel_split_us(kernels, "mosaic_gpu", per_device)
               if kernels and not label.startswith("xla") else None)
      cname = cname or ("-" if label.startswith("xla") else "table")
      print(f"{r['name']:32} {r['d']:>2} {cname:>10} {variant:>10} {t:9.1f} "
            f"{t / med['xla_gemm']:10.3f}" + (f" {split[0]:9.1f} {split[1]:8.1f}" if split else ""))
  for r in rows:  # with a producer: which kernels each call launched (is the fill its own?)
    if r.get("producer") and r.get("kernels"):
      print(f"{r['name']} kernels per call (name: count x median us):")
      for label, kernels in r["kernels"].items():
        print(f"  {label}: " + ", ".join(f"{name}: {info['count_per_iteration']} x "
                                         f"{info['median_us']:.1f}"
                                         for name, info in kernels.items()))
  checked = [(r["name"], label) for r in rows for label in r.get("rule_holds", {})]
  broken = [(r["name"], label) for r in rows for label, ok in r.get("rule_holds", {}).items()
            if not ok]
  if checked:
    print(f"error rule (<= {bench_env.MAX_ERROR_RATIO} x the unfused path's): "
          f"{len(broken)} of {len(checked)} kernel outputs broke it{': ' if broken else ''}"
          + ", ".join(f"{name} {label}" for name, label in broken))
  print("wrote", out)
  if broken:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
