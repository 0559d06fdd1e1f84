"""The GEMM core at small M on one GPU: pallas_rs's kernel at D = 1 and jax's own Hopper matmul
(with and without cluster TMA multicast) against XLA's dot (issue 19).

  PYTHONPATH=. python experiments/gemm_core.py --ms=512,2048 --ds=2,8

Per projection of the seed table, per M in --ms and per D in --ds, the per-GPU GEMM
x [M, K/D] @ w [K/D, N] (D = 8's k_shard is the proxy8 shapes'); times (CUPTI, median of
--iterations) XLA's dot, `fused.local_matmul` with the config variants of --ours
(`config_variants.variant_config` tokens applied to the tuning table's config for the D-device
shape, comm fields dropped: at D = 1 the kernel is its GEMM core, the "neither" ablation's
work without the split into chunks) and `hopper_matmul_mgpu.matmul` with the TuningConfigs of
--jax (tile_m x tile_n per warpgroup, wg split M or N, cluster multicast along M or N or none).
The variants with the `pp` token are the ping-pong body (Config.pingpong); the table shows the
best of them beside the best of the others.
Every output is checked against an f32 reference (error <= 1.1x XLA's). XLA's dot is the
benchmarks' (`pallas_rs.reference.dot`: the output dtype asked of XLA); --xla adds other forms of
the same arithmetic (fp32 accumulation, one rounding): "f32_astype", an fp32 product then a cast
(the benchmarks' form until 2026-12-06: XLA runs it as a Triton GEMM with the cast fused or
as cuBLAS writing fp32 then a convert kernel), "plain",
`jnp.dot(x, w)`. --ablations times each of ours also without stages (timing only: "store", the
mainloop and the sub-tiles' SMEM writes; "gemm", the epilogue alone). Each function's kernels
(CUPTI names) go into the JSON. JSON after every case under --out; a table last (time / XLA's
dot).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
import statistics
import sys

import bench_env  # experiments/ is sys.path[0] when run as a script.
from config_variants import tuned_config
from config_variants import variant_config
import flag_checks

from absl import app
from absl import flags

_PROJECTIONS = ("llama70b_o_proj", "llama70b_down_proj", "mixtral8x22b_o_proj",
                "mixtral8x22b_w2")
_PROJ = flags.DEFINE_list("projections", list(_PROJECTIONS), "Seed projections.")
_MS = flags.DEFINE_list("ms", ["512", "2048"], "Global M (the seed's: 512, 2048, 8192, 32768).")
_DS = flags.DEFINE_list("ds", ["2", "8"], "Devices D: the GEMM is M x K/D x N.")
_OURS = flags.DEFINE_list("ours", ["table", "t128x128_s4", "t64x128_s4", "t128x64_s4",
                                   "t64x192_wm_s4", "t64x256_wm_s4", "t128x128_wm_s4"],
                          "pallas_rs config variants (D = 1).")
# tile_m x tile_n (per warpgroup), wg split dimension, cluster dimension (- = none).
_JAX = flags.DEFINE_list("jax", ["128x128_N_-", "128x128_N_M", "64x192_M_-", "64x192_M_N"],
                         "jax hopper_matmul_mgpu TuningConfigs tMxtN_wgdim_clusterdim.")
# The forms of XLA's dot besides "xla_dot" (`pallas_rs.reference.dot`); each is timed as
# "xla_dot:<form>". Until 2026-12-06 every baseline was "f32_astype".
XLA_FORMS = {"f32_astype": lambda a, b: jnp_dot(
                 a, b, preferred_element_type="float32").astype(a.dtype),
             "plain": lambda a, b: jnp_dot(a, b)}
_XLA = flags.DEFINE_list("xla", [], f"Other forms of XLA's dot, of {sorted(XLA_FORMS)}.")
_ABLATIONS = flags.DEFINE_list(
    "ablations", [], "Stage sets (rank.ABLATIONS joined by '+', e.g. store: no TMA stores) "
    "each --ours variant is also timed without, as 'ours:<variant>:no<set>'; timing only (the "
    "output is wrong): not checked, never the best.")
_STEPS = flags.DEFINE_integer("steps", 4, "jax configs: pipeline steps (fit to SMEM down).")
_ITERS = flags.DEFINE_integer("iterations", 50, "Timed iterations per variant.")
_TIMING = flag_checks.TimingFlags(__name__, "a shape's variants")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/gemm_core.json.")


def jnp_dot(a, b, **kwargs):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return jnp.dot(a, b, **kwargs)


def jax_config(hm, token: str, steps: int):
  """hopper_matmul_mgpu.TuningConfig of a token '128x64_M_N'."""
  tiles, wg, cluster = token.split("_")
  tile_m, tile_n = (int(v) for v in tiles.split("x"))
  dim = lambda s: None if s == "-" else hm.MatmulDimension[s]
  return hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=steps,
                         epi_tile_m=64, epi_tile_n=64, wg_dimension=dim(wg),
                         cluster_dimension=dim(cluster))


def jax_matmul(hm, config):
  params = inspect.signature(hm.matmul).parameters
  if "c" in params:
    return lambda a, b: hm.matmul(a, b, None, config=config)
  return lambda a, b: hm.matmul(a, b, config=config)


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  flag_checks.subset("projections", _PROJ.value, _PROJECTIONS)
  flag_checks.positive_ints("ms", _MS.value)
  flag_checks.positive_ints("ds", _DS.value)
  _TIMING.check()
  flag_checks.variant_names("ours", _OURS.value)
  flag_checks.subset("xla", _XLA.value, sorted(XLA_FORMS))
  from pallas_rs.kernel import rank  # pylint: disable=g-import-not-at-top
  flag_checks.subset("ablations", [part for a in _ABLATIONS.value for part in a.split("+")],
                     sorted(rank.ABLATIONS))


def main(argv):
  del argv
  bench_env.configure_environment("single_gpu")
  check_flags()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import alternating  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top

  bench_env.require_gpu("gemm_core.py", "times Mosaic GPU kernels")
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("gemm_core.json")
  environment = bench_env.environment_block(sys.argv)
  rows = []
  for proj in _PROJ.value:
    for m in (int(v) for v in _MS.value):
      for d in (int(v) for v in _DS.value):
        case = shapes.by_name(f"{proj}_m512")  # the projection's K and N; M is any --ms
        k_shard, n = case.k // d, case.n
        row = dict(name=f"{proj}_m{m}", d=d, m=m, k_shard=k_shard, n=n, times_us={},
                   configs={}, max_rel_error={}, kernels={})
        x, w = testing.generate(0, m, k_shard, n)
        ref = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32,
                                           precision="highest"))(x, w)
        fns = {"xla_dot": jax.jit(reference.dot)}
        fns.update({f"xla_dot:{form}": jax.jit(XLA_FORMS[form]) for form in _XLA.value})
        try:
          base = tuned_config(m=m, k_shard=k_shard, n=n, dtype=x.dtype, num_devices=d)
        except NotImplementedError:
          base = config_lib.Config()
        base = dataclasses.replace(base, comm_ctas=0, comm_mode="push", eager_signal_steps=0,
                                   out_slots=0)
        for token in _OURS.value:
          cfg = variant_config(base, token, num_devices=1)
          if repr(cfg) in row["configs"].values():
            continue  # The same kernel as an earlier variant.
          try:
            cfg.check_shape(m=m, n=n, k_shard=k_shard, num_devices=1)
          except (NotImplementedError, ValueError) as e:
            row["configs"][f"ours:{token}"] = f"unavailable: {e}"
            continue
          row["configs"][f"ours:{token}"] = repr(cfg)
          fns[f"ours:{token}"] = jax.jit(functools.partial(fused.local_matmul, config=cfg))
          for stages in _ABLATIONS.value:
            fns[f"ours:{token}:no{stages}"] = jax.jit(functools.partial(
                fused.local_matmul, config=cfg, ablate=tuple(stages.split("+"))))
        for token in _JAX.value:
          for steps in range(_STEPS.value, 1, -1):  # The deepest pipeline that fits SMEM.
            fn = jax.jit(jax_matmul(hm, jax_config(hm, token, steps)))
            try:
              fn.lower(x, w).compile()
            except Exception as e:  # pylint: disable=broad-except
              if "shared memory" in str(e):
                continue
              row["configs"][f"jax:{token}"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
              break
            row["configs"][f"jax:{token}"] = repr(jax_config(hm, token, steps))
            fns[f"jax:{token}"] = fn
            break
        # A config the kernel rejects or that does not fit SMEM: recorded, not fatal.
        fail = lambda label, e: row["configs"].__setitem__(
            label, f"failed: {type(e).__name__}: {str(e)[:300]}")
        compiled = {}
        for label, fn in fns.items():
          try:
            compiled[label] = (timing.compile_function(fn, (x, w))[0], (x, w))
          except Exception as e:  # pylint: disable=broad-except
            fail(label, e)
        # Timed in rounds, in turn within each (BUILD_NOTES, seventy-seventh session).
        timings = alternating.time_alternating(compiled, iterations=_ITERS.value,
                                               num_devices=1, on_error=fail,
                                               **_TIMING.kwargs(_ITERS.value))
        for label, t in timings.items():
          row["times_us"][label] = t.times_us
          row["kernels"][label] = t.kernels
          row.setdefault("timer", t.timer)
          if _ablated(label):
            continue  # Its output is wrong by design.
          try:
            row["max_rel_error"][label] = reference.max_rel_error(
                jax.device_get(compiled[label][0](x, w)), jax.device_get(ref))
          except Exception as e:  # pylint: disable=broad-except
            fail(label, e)
            del row["times_us"][label], row["kernels"][label]
        rows.append(row)
        med = {k: statistics.median(v) for k, v in row["times_us"].items()}
        print(row["name"], f"D={d}", {k: round(v, 1) for k, v in med.items()}, flush=True)
        bench_env.write_json(out, bench_env.sanitize(dict(environment=environment, rows=rows)))

  print()
  print(table(rows))


def _ablated(label: str) -> bool:
  """Whether `label` is an --ablations variant ("ours:<variant>:no<set>"; a variant name has no
  colon, though it may start with "no", as "nopf" does)."""
  return label.startswith("ours:") and label.count(":") == 2


def table(rows) -> str:
  """Per row: XLA's median, the fastest of ours (cooperative), of jax's and of ours with the
  ping-pong body (Config.pingpong, the `pp` token; told by the config's repr in the JSON) among
  those whose output kept the rule (error <= 1.1x XLA's + 1e-6; a NaN error or a missing XLA
  error does not), and how many were dropped from that pick: "bad err"
  (checked, over the rule), "failed" (did not build or run); last, each --xla form's time /
  XLA's (the forms that kept the rule) and each ablated variant's (--ablations)."""
  lines = [f"{'shape':26} {'D':>2} {'xla us':>7} {'best ours':>18} {'/xla':>6} "
           f"{'best jax':>16} {'/xla':>6} {'best pp':>18} {'/xla':>6} {'bad err':>7} "
           f"{'failed':>6} xla forms, ablated /xla"]
  for r in rows:
    med = {k: statistics.median(v) for k, v in r["times_us"].items()}
    xla = med.get("xla_dot", float("nan"))
    xla_err = r["max_rel_error"].get("xla_dot")
    bad = [k for k, e in r["max_rel_error"].items() if k != "xla_dot" and not (
        xla_err is not None and bench_env.rule_holds(e, xla_err, slack=1e-6))]
    failed = [k for k, c in r["configs"].items() if str(c).startswith("failed")]
    pp = lambda k: "pingpong=True" in str(r["configs"].get(k))
    pick = lambda p, keep=lambda k: True: min(
        ((v, k) for k, v in med.items()
         if k.startswith(p) and k not in bad and not _ablated(k) and keep(k)),
        default=(float("nan"), "-"))
    (to, ko), (tj, kj) = pick("ours:", lambda k: not pp(k)), pick("jax:")
    tp, kp = pick("ours:", pp)
    forms = " ".join([f"{k[8:]}={v / xla:.3f}" for k, v in med.items()
                      if k.startswith("xla_dot:") and k not in bad] +
                     [f"{k[5:]}={v / xla:.3f}" for k, v in med.items() if _ablated(k)])
    lines.append(f"{r['name']:26} {r['d']:>2} {xla:7.1f} {ko[5:]:>12} {to:5.1f} "
                 f"{to / xla:6.3f} {kj[4:]:>12} {tj:5.1f} {tj / xla:6.3f} {kp[5:]:>12} {tp:5.1f} "
                 f"{tp / xla:6.3f} {len(bad):>7} "
                 f"{len(failed):>6} {forms}".rstrip())
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
