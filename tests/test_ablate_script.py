"""experiments/ablate.py's plumbing on 8 CPU devices, with the kernel replaced by a stand-in
(the fused kernel cannot run on a CPU): variants, baselines, the check, the JSON."""
import json

import pytest

import helpers

STAND_INS = """
def stand_in(x, w, *, axis_name, num_devices, config=None, ablate=(), unverified=False):
  out = reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
  if ablate:
    return out * 0  # ablated variants are wrong by construction
  return out * 1.0625 if config.comm_ctas == 4 else out  # one wrong kernel: the rule fails it
fused.fused_matmul_reduce_scatter = stand_in
"""


# The scripts refuse to run without a GPU; their stand-in kernels run on the CPU.
_NO_GPU_CHECK = "mod.bench_env.require_gpu = lambda script, what: None\n"


@pytest.mark.slow  # ~30 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_ablate_script_plumbing(tmp_path):
  out = tmp_path / "ablate.json"
  proc = helpers.run_script_with_stand_ins(
      "ablate.py", ["--names=llama70b_o_proj_m512", "--iterations=2", f"--out={out}",
                    "--configs=table,t64x128,t64x128_c4", "--ablations=fused,neither,moves"],
      stand_ins=STAND_INS, after_load=_NO_GPU_CHECK)
  assert proc.returncode == 1, proc.stderr[-3000:]  # the wrong kernel
  assert ("1 of 3 kernel outputs broke it: llama70b_o_proj_m512 t64x128_c4:fused"
          in proc.stdout), proc.stdout[-3000:]
  result = json.loads(out.read_text())
  (row,) = result["rows"]
  assert row["d"] == 8 and row["transport"] == "nvlink"
  assert set(row["times_us"]) == {f"{c}{v}" for c in ("", "t64x128:", "t64x128_c4:")
                                  for v in ("fused", "neither", "moves")} | {"xla_seq", "xla_gemm"}
  assert "tile_m=64" in row["configs"]["t64x128"] and "tile_n=128" in row["configs"]["t64x128"]
  assert all(len(v) == 2 and min(v) > 0 for v in row["times_us"].values())
  # Every unablated kernel is checked (bf16 output of the stand-in).
  assert set(row["max_rel_error"]) == {"fused", "t64x128:fused", "t64x128_c4:fused"}
  assert row["rule_holds"] == {"fused": True, "t64x128:fused": True, "t64x128_c4:fused": False}
  unfused = row["unfused_max_rel_error"]  # per checked kernel: NCCL's over NVLink, one value
  assert set(unfused) == set(row["max_rel_error"]) and len(set(unfused.values())) == 1
  assert 0 < unfused["t64x128_c4:fused"] < 2.0**-7
  assert row["max_rel_error"]["t64x128_c4:fused"] > 1.1 * unfused["t64x128_c4:fused"]
  assert max(row["max_rel_error"][k] for k in ("fused", "t64x128:fused")) < 2.0**-7
  # The comm CTAs' rate: the bytes one rank's 4 comm CTAs move (7 of 8 bf16 chunks of
  # 64 x 8192) over the median "moves" time, per CTA; none for configs without comm CTAs.
  (rate,) = row["comm_gbps_per_cta"].items()
  t = sorted(row["times_us"]["t64x128_c4:moves"])
  assert rate[0] == "t64x128_c4:moves"
  assert rate[1] == pytest.approx(7 * 64 * 8192 * 2 / ((t[0] + t[1]) / 2 * 1e3) / 4)
  assert result["environment"]["jax_version"]


ALONE_STAND_IN = """
import jax.numpy as jnp
def rank_alone(x, w, *, num_devices, rank=0, config=None, ablate=("comm",)):
  assert "comm" in ablate
  chunk = x.shape[0] // num_devices
  return jnp.dot(x[rank * chunk:(rank + 1) * chunk], w)
fused.rank_alone = rank_alone
"""


# Per-kernel records as CUPTI gives them on a GPU (BUILD_NOTES 2026-12-07, 106th): a D > 1
# call's zero-fill of its semaphores beside the Mosaic kernel; XLA's dot one kernel.
_WITH_KERNELS = """
from pallas_rs.bench import alternating as _alt
_real = _alt.time_alternating
def _with_kernels(fns, **kw):
  out = _real(fns, **kw)
  for label, t in out.items():
    t.kernels = ({"nvjet_gemm": dict(count_per_iteration=1, median_us=9.3, max_us=9.4)}
                 if label.startswith("xla") else
                 {"loop_broadcast_fusion": dict(count_per_iteration=1, median_us=0.9, max_us=1),
                  "pallas_rs_rank_alone_mosaic_gpu_kernel": dict(
                      count_per_iteration=1, median_us=9.6, max_us=9.7)})
  return out
_alt.time_alternating = _with_kernels
"""


# Each trace of --producer's SwiGLU, printed (a model's x computed in the same jit).
_SPY_PRODUCER = """
from pallas_rs import model as _model
_swiglu = _model.swiglu
def _spy(gate, up, dtype):
  print("producer traced", flush=True)
  return _swiglu(gate, up, dtype)
_model.swiglu = _spy
"""


@pytest.mark.slow  # ~30 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_ablate_script_alone(tmp_path):
  out = tmp_path / "ablate.json"
  args = ["--alone", "--num_devices=8", "--rank=3", "--names=llama70b_o_proj_m512",
          "--iterations=2", f"--out={out}", "--configs=table", "--ablations=no_comm,neither"]
  proc = helpers.run_script_with_stand_ins(
      "ablate.py", args, stand_ins=ALONE_STAND_IN,
      after_load=_NO_GPU_CHECK)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert (row["d"], row["rank"], row["transport"]) == (8, 3, "alone")
  assert set(row["times_us"]) == {"no_comm", "neither", "xla_gemm"}
  assert "max_rel_error" not in row  # nothing unablated to check
  assert "kernels" not in row  # the host timer has no per-kernel records
  # With CUPTI's per-kernel records (here attached to the host timings) the JSON keeps them
  # and the table splits the Mosaic kernel from what else the call launched.
  proc = helpers.run_script_with_stand_ins(
      "ablate.py", args, stand_ins=ALONE_STAND_IN,
      after_load=_NO_GPU_CHECK + _WITH_KERNELS)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert set(row["kernels"]) == {"no_comm", "neither", "xla_gemm"}
  lines = [l.split() for l in proc.stdout.splitlines() if l.startswith("llama70b_o_proj_m512 ")]
  assert [l[3] for l in lines if len(l) == 8] == ["no_comm", "neither"], proc.stdout
  assert all(l[-2:] == ["9.6", "0.9"] for l in lines if len(l) == 8)
  assert [len(l) for l in lines if l[3] == "xla_gemm"] == [6]
  # With a producer in the same jit (as in a model) every function computes its x by it (each
  # traces it once: the two variants and XLA's dot), the row says so and the table lists each
  # call's kernels by name.
  proc = helpers.run_script_with_stand_ins(
      "ablate.py", args + ["--producer=swiglu"], stand_ins=ALONE_STAND_IN,
      after_load=_NO_GPU_CHECK + _WITH_KERNELS
      + _SPY_PRODUCER)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("producer traced") == 3, proc.stdout
  (row,) = json.loads(out.read_text())["rows"]
  assert row["producer"] == "swiglu" and set(row["times_us"]) == {"no_comm", "neither", "xla_gemm"}
  assert ("  no_comm: loop_broadcast_fusion: 1 x 0.9, pallas_rs_rank_alone_mosaic_gpu_kernel: "
          "1 x 9.6" in proc.stdout.splitlines()), proc.stdout
  assert "  xla_gemm: nvjet_gemm: 1 x 9.3" in proc.stdout.splitlines()
  # A producer without --alone, and an ablation that needs peers, are refused before anything
  # runs.
  proc = helpers.run_script_with_stand_ins(
      "ablate.py", args[1:] + ["--producer=swiglu"], stand_ins=ALONE_STAND_IN,
      after_load=_NO_GPU_CHECK)
  assert proc.returncode != 0 and "--producer needs --alone" in proc.stderr
  proc = helpers.run_script_with_stand_ins(
      "ablate.py", args[:-1] + ["--ablations=fused,neither"], stand_ins=ALONE_STAND_IN,
      after_load=_NO_GPU_CHECK)
  assert proc.returncode != 0 and "drop ['fused']" in proc.stderr


LOOPBACK_STAND_IN = """
def stand_in_loopback(xs, ws, *, config=None, ablate=()):
  # As the kernel: the ring's numerics sum in NCCL's ring order, the others in source order.
  order = "ring" if config.numerics == "unfused_order" else "source"
  out = reference.loopback_matmul_reduce_scatter(xs, ws, order=order)
  return out * 0 if ablate else out
fused.loopback_matmul_reduce_scatter = stand_in_loopback
"""


@pytest.mark.slow  # ~40 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_ablate_judges_a_loopback_kernel_by_the_order_its_numerics_copies(tmp_path):
  # On one GPU (here: one of the CPU devices) the unfused path is emulated; a config in the
  # ring's numerics is judged against the ring order it copies, the others against source
  # order (2026-12-02: overlap_probe judged ring configs at D = 4/8 against source order and
  # failed them at ratio 1.2-1.3, with the unfused path's own arithmetic).
  out = tmp_path / "ablate.json"
  proc = helpers.run_script_with_stand_ins(
      "ablate.py", ["--num_devices=4", "--names=mixtral8x22b_o_proj_m512", "--iterations=2",
                    f"--out={out}", "--configs=table,ring", "--ablations=fused"],
      stand_ins=LOOPBACK_STAND_IN,
      after_load=(_NO_GPU_CHECK +
                  "import jax\n_all = jax.devices\njax.devices = lambda *a: _all(*a)[:1]"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert (row["d"], row["transport"]) == (4, "loopback")
  assert "owner_sum='fp32'" in row["configs"]["table"]
  assert "owner_sum='bf16_ring'" in row["configs"]["ring"]
  err, unfused = row["max_rel_error"], row["unfused_max_rel_error"]
  # The stand-ins are the emulation itself, so each kernel's error is its baseline's exactly.
  assert unfused == err and set(err) == {"fused", "ring:fused"}
  assert err["fused"] != err["ring:fused"]  # two orders, two roundings
  assert row["rule_holds"] == {"fused": True, "ring:fused": True}
