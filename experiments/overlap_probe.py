"""Communication paths of the fused kernel side by side, on real NVLink (docs/design.md 3.2).

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python experiments/overlap_probe.py --what=check,time

"check": every config variant (direct push v1, comm CTAs, fp32 partials) against an fp32
reference and the unfused path (in loopback its emulation, summed in the order the variant's
numerics copies: testing.unfused_order), at D = the visible GPUs (NVLink) and in loopback at
D = 2, 4, 8 on one GPU; each run twice (bit-determinism), and every bf16-partial variant
bit-compared with v1 (same arithmetic, other transport: the bits must agree); exit code 1 if
a check fails (the error rule, determinism or those bits).
"time": per shape, XLA's dot (T_gemm), psum_scatter alone (T_comm), dot + psum_scatter
(T_seq), and each variant with and without its communication (ablate="comm": the exposed
communication is the difference). JSON with raw times under --out; a table last.
"""
from __future__ import annotations

import functools
from pathlib import Path
import statistics
import sys
import time

import bench_env  # experiments/ is sys.path[0] when run as a script.
from config_variants import variant_config
import flag_checks

from absl import app
from absl import flags

_WHAT = flags.DEFINE_list("what", ["check", "time"], "check and/or time.")
_NAMES = flags.DEFINE_list(
    "names", ["llama70b_o_proj_m512", "mixtral8x22b_w2_m512", "mixtral8x22b_o_proj_m2048",
              "llama70b_o_proj_m8192", "llama70b_down_proj_m8192"],
    "Shapes (pallas_rs.shapes) to time; k_shard = k // D.")
_PROXY = flags.DEFINE_list(
    "proxy", ["llama70b_o_proj_m8192", "mixtral8x22b_w2_m2048"],
    "Shapes also timed as their proxy8 case (k = K / 4: at D = 2 the k_shard of D = 8).")
_VARIANTS = flags.DEFINE_list(
    "variants", ["v1", "c2", "c4", "c8", "c16", "c4_f32", "v1_f32"],
    "Config variants (config_variants.variant_config): v1, cN, pN, oN, tMxN, sK, f32/bf16, "
    "ring tokens, e.g. c4_bf16.")
_ITERS = flags.DEFINE_integer("iterations", 40, "Timed iterations per variant.")
_TIMING = flag_checks.TimingFlags(__name__, "a shape's functions")
_COMM_ABLATIONS = flags.DEFINE_list(
    "comm_ablations", ["gemm", "gemm+stage_wait"],
    "Ablation sets (kernel.ABLATIONS joined by '+') also timed for comm-CTA variants; each "
    "starting with 'gemm' yields an in-kernel comm rate (comm_gbps_<rest>).")
_SCALE = flags.DEFINE_integer("scale", 1, "Divide the check cases' n and k_shard by this "
                              "(plumbing tests on CPU).")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/"
                           "overlap_probe.json (git-ignored).")


def check_flags() -> None:
  """UsageError for a flag value that would fail later in the run (flag_checks)."""
  from pallas_rs.kernel import rank  # pylint: disable=g-import-not-at-top
  flag_checks.subset("what", _WHAT.value, ("check", "time"))
  flag_checks.shape_names("names", _NAMES.value)
  flag_checks.shape_names("proxy", [name + "_proxy8" for name in _PROXY.value])
  flag_checks.variant_names("variants", _VARIANTS.value)
  _TIMING.check()
  flag_checks.subset("comm_ablations", [part for a in _COMM_ABLATIONS.value
                                        for part in a.split("+")], rank.ABLATIONS)


def main(argv):
  del argv
  bench_env.configure_environment("auto")
  check_flags()
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import defaults  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import alternating  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top

  bench_env.require_gpu("overlap_probe.py", "runs the Mosaic GPU kernel")
  gpus = jax.devices()
  d_nv = len(gpus)
  record = dict(environment=bench_env.environment_block(sys.argv), checks=[], rows=[])
  out_path = Path(_OUT.value) if _OUT.value else bench_env.default_out("overlap_probe.json")

  def save():
    bench_env.write_json(out_path, bench_env.sanitize(record))

  if d_nv >= 2:
    mesh = jax.make_mesh((d_nv,), ("tp",), devices=gpus)
    specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None),
                 check_vma=False)
    unfused = jax.jit(jax.shard_map(functools.partial(
        reference.matmul_reduce_scatter, axis_name="tp"), **specs))

  def fused_fn(cfg, ablate=()):
    return jax.jit(jax.shard_map(functools.partial(
        fused.fused_matmul_reduce_scatter, axis_name="tp", num_devices=d_nv, config=cfg,
        ablate=ablate), **specs))

  def global_operands(seed, m, k_shard, n):
    """x [m, D k_shard], w [D k_shard, n] generated in place on the mesh (pallas_rs.bench.testing)."""
    return testing.generate(seed, m, d_nv * k_shard, n, num_devices=d_nv,
                            shardings=testing.row_parallel_shardings(mesh, "tp"))

  # ---------------------------------------------------------------- check
  if "check" in _WHAT.value:
    sc = _SCALE.value
    cases = [("nvlink", d_nv, 512 * d_nv, 1024 // sc, 2048 // sc),
             ("nvlink", d_nv, 256 * d_nv, 1536 // sc, 1536 // sc)]  # n: 128 | n // sc
    cases += [("loopback", d, 128 * d * 2, 1024 // sc, 512 // sc) for d in (2, 4, 8)]
    for transport, d, m, n, k_shard in cases:
      if transport == "nvlink" and d < 2:
        continue
      if transport == "nvlink":
        args = global_operands(m + n + d, m, k_shard, n)
        ref = testing.stacked_reference(*testing.split_inputs(*args, d))
        check_unfused = unfused
        get = lambda o, d=d, m=m, n=n: np.asarray(
            jax.device_get(o).astype(np.float32)).reshape(d, m // d, n)
      else:
        args = testing.stacked_inputs(m + n + d, d, m, k_shard, n)
        ref = testing.stacked_reference(*args)
        check_unfused = None  # per variant: the order its numerics copies
        get = lambda o: np.asarray(jax.device_get(o).astype(np.float32))
      base = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
      outs = {}
      for name in _VARIANTS.value:
        cfg = variant_config(base, name)
        if transport == "loopback" and cfg.comm_ctas >= cfg.num_sms // d:
          continue
        try:
          if transport == "nvlink":
            fn = fused_fn(cfg)
          else:
            fn = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
          a = get(fn(*args))
          b = get(fn(*args))
          err = reference.max_rel_error(a, ref)
          unfused_fn = check_unfused or testing.loopback_unfused(testing.unfused_order(cfg))
          unfused_out = get(unfused_fn(*args))
          err_unfused = reference.max_rel_error(unfused_out, ref)
          row = dict(transport=transport, d=d, m=m, n=n, k_shard=k_shard, variant=name,
                     config=tuning.config_to_json(cfg),
                     err=err, err_unfused=err_unfused, ratio=err / err_unfused,
                     deterministic=bool(np.array_equal(a, b)),
                     nan=bool(np.isnan(a).any()),
                     share_equal_unfused=float(np.mean(a == unfused_out)))
          # Same arithmetic, other transport: the bits must equal the direct push's (the
          # first variant without comm CTAs in the same numerics mode).
          same = outs.setdefault(("v1", cfg.numerics), a) if not cfg.comm_ctas else (
              outs.get(("v1", cfg.numerics)))
          if same is not None:
            row["bits_equal_v1"] = bool(np.array_equal(a, same))
          # A race shows as a moving result; another transport as other bits.
          row["passed"] = (bench_env.rule_holds(err, err_unfused) and row["deterministic"]
                           and row.get("bits_equal_v1", True))
        except NotImplementedError as e:  # a variant this shape or transport does not take
          row = dict(transport=transport, d=d, m=m, n=n, variant=name,
                     unavailable=str(e)[:500])
        except Exception as e:  # pylint: disable=broad-except
          row = dict(transport=transport, d=d, m=m, n=n, variant=name, error=repr(e)[:500],
                     passed=False)
        record["checks"].append(row)
        print("check", {k: v for k, v in row.items() if k != "config"}, flush=True)
        save()

  # ---------------------------------------------------------------- time
  if "time" in _WHAT.value and d_nv >= 2:
    d = d_nv
    todo = _NAMES.value + [name + "_proxy8" for name in _PROXY.value]  # shapes' proxy8 cases
    for label in todo:
      case = shapes.by_name(label)
      m, n, k_shard = case.m, case.n, case.k // d
      base = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
      args = global_operands(1, m, k_shard, n)
      y = jax.device_put(jnp.zeros((m * d, n), jnp.bfloat16) + 1, NamedSharding(mesh, P("tp", None)))
      row = dict(name=label, d=d, m=m, n=n, k_shard=k_shard, times_us={}, configs={})
      base_fns = {
          "xla_gemm": (jax.jit(jax.shard_map(
              reference.dot, **dict(specs, out_specs=P(None, "tp")))), args),
          "xla_comm": (jax.jit(jax.shard_map(
              lambda t: lax.psum_scatter(t, "tp", scatter_dimension=0, tiled=True),
              mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None), check_vma=False)), (y,)),
          "xla_seq": (unfused, args),
      }
      errors = lambda key, e: row.setdefault("errors", {}).__setitem__(key, repr(e)[:500])
      items = {key: (timing.compile_function(fn, a)[0], a) for key, (fn, a) in base_fns.items()}
      for vname in _VARIANTS.value:
        cfg = variant_config(base, vname)
        row["configs"][vname] = tuning.config_to_json(cfg)
        # "_no<a>_<b>...": the kernel without stages a, b (kernel.ABLATIONS). "_nogemm": its
        # data movement alone; with comm CTAs that is their rate inside the kernel (comm_gbps
        # below; "_nogemm_stage_wait" etc.: also without that stage).
        ablations = [(), ("comm",)] + (
            [tuple(a.split("+")) for a in _COMM_ABLATIONS.value] if cfg.comm_ctas else [])
        for ablate in ablations:
          key = vname + ("_no" + "_".join(ablate) if ablate else "")
          try:
            items[key] = (timing.compile_function(fused_fn(cfg, ablate), args)[0], args)
          except Exception as e:  # pylint: disable=broad-except
            errors(key, e)
      # Timed in rounds, each function in turn within a round (a slow phase of the GPUs falls
      # on all alike: BUILD_NOTES, seventy-seventh session).
      t0 = time.time()
      timings = alternating.time_alternating(items, iterations=_ITERS.value,
                                             num_devices=d, on_error=errors,
                                             **_TIMING.kwargs(_ITERS.value))
      row["times_us"].update({key: t.times_us for key, t in timings.items()})
      print(label, f"{len(timings)} functions timed in {time.time() - t0:.1f}s", flush=True)
      # Bytes each GPU sends: its D - 1 peer chunks of partials.
      for vname, cfg_json in row["configs"].items():
        for key, times in row["times_us"].items():
          if not key.startswith(vname + "_nogemm"):
            continue
          itemsize = 4 if cfg_json["partial_dtype"] == "float32" else 2
          sent = (d - 1) * (m // d) * n * itemsize
          gbps = sent / (statistics.median(times) * 1e3)
          row.setdefault("comm_gbps" + key[len(vname + "_nogemm"):], {})[vname] = dict(
              total=gbps, per_comm_cta=gbps / cfg_json["comm_ctas"], bytes_per_gpu=sent)
      record["rows"].append(row)
      save()
      med = {k_: statistics.median(v) for k_, v in row["times_us"].items()}
      print(label, {k_: round(v, 1) for k_, v in med.items()}, flush=True)

  # ---------------------------------------------------------------- summary
  print("\nchecks: variant transport D ratio deterministic bits_equal_v1 share_equal_unfused "
        "verdict")
  for c in record["checks"]:
    verdict = "unavailable" if "unavailable" in c else "ok" if c["passed"] else "FAILED"
    print(f"  {c['variant']:12} {c['transport']:8} {c['d']} "
          f"{c.get('ratio', float('nan')):.3f} {c.get('deterministic')} "
          f"{c.get('bits_equal_v1', '-')} {c.get('share_equal_unfused', float('nan')):.4f} "
          f"{verdict} {c.get('error', c.get('unavailable', ''))[:80]}")
  judged = [c for c in record["checks"] if "passed" in c]
  failed = [c for c in judged if not c["passed"]]
  if judged:
    print(f"checks: {len(failed)} of {len(judged)} failed (error rule <= "
          f"{bench_env.MAX_ERROR_RATIO} x the unfused path's, deterministic, the bits of v1)")
  if record["rows"]:
    print("\ntimes (us, median): shape gemm comm seq | variant fused/nocomm ...")
    for r in record["rows"]:
      med = {k_: statistics.median(v) for k_, v in r["times_us"].items()}
      head = f"{r['name'][:30]:30} {med['xla_gemm']:8.1f} {med['xla_comm']:8.1f} {med['xla_seq']:8.1f} |"
      cells = [f"{v}:{med.get(v, float('nan')):.0f}/{med.get(v + '_nocomm', float('nan')):.0f}"
               for v in _VARIANTS.value]
      print(head, " ".join(cells))
      for v, g in r.get("comm_gbps", {}).items():
        extra = "".join(f"; without {k[len('comm_gbps_'):]} {r[k][v]['per_comm_cta']:.1f}"
                        for k in sorted(r) if k.startswith("comm_gbps_") and v in r[k])
        print(f"{'':30} {v}: comm alone {g['total']:.0f} GB/s, {g['per_comm_cta']:.1f} per "
              f"comm CTA{extra}")
  timing_errors = sum(len(r.get("errors", {})) for r in record["rows"])
  if timing_errors:
    print(f"times: {timing_errors} variants failed to run (the rows' 'errors')")
  print("wrote", out_path)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
