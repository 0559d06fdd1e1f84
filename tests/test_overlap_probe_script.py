"""experiments/overlap_probe.py's plumbing on 8 CPU devices, with the kernel replaced by a
stand-in (the fused kernel cannot run on a CPU): variant names, checks, timing rows, JSON."""
import dataclasses
import json

import pytest

import helpers
from pallas_rs.kernel import defaults

STAND_INS = """
def stand_in(x, w, *, axis_name, num_devices, config=None, ablate=()):
  return reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
def stand_in_loopback(xs, ws, *, config=None, ablate=()):
  out = reference.loopback_matmul_reduce_scatter(xs, ws)
  # One wrong case (c2 at D = 8), which the check must fail and the exit code report.
  return out * 1.0625 if config.comm_ctas == 2 and xs.shape[0] == 8 else out
fused.fused_matmul_reduce_scatter = stand_in
fused.loopback_matmul_reduce_scatter = stand_in_loopback
"""


@pytest.fixture(scope="module")
def overlap_probe():
  yield helpers.load_script("overlap_probe")
  helpers.forget_scripts("overlap_probe")  # Its absl flags share names with other scripts'.


def test_variant_names(overlap_probe):
  base = defaults.default_config(m=8192, n=8192, k_shard=4096, num_devices=2)
  assert overlap_probe.variant_config(base, "v1") == base
  # Tokens whose value the base has already are applied after one that changes it (f32, wn).
  c4 = overlap_probe.variant_config(base, "f32_c4_bf16")
  assert (c4.comm_ctas, c4.partial_dtype, c4.epi_tile_n) == (4, "bfloat16", 64)
  o4 = overlap_probe.variant_config(base, "o4_bf16")
  assert o4.num_out_slots == 4 and o4.fits_smem(2)
  assert overlap_probe.variant_config(base, "o4").numerics == base.numerics == "unfused_order"
  assert overlap_probe.variant_config(base, "o4_f32").partial_dtype == "float32"
  p4 = overlap_probe.variant_config(base, "f32_p4_ring")
  assert (p4.comm_ctas, p4.comm_mode, p4.numerics) == (4, "pull", "unfused_order")
  t = overlap_probe.variant_config(base, "t64x128_s4_p8")
  assert (t.tile_m, t.tile_n, t.comm_ctas, t.comm_mode) == (64, 128, 8, "pull")
  assert t.max_concurrent_steps <= 4 and t.fits_smem(2)
  assert overlap_probe.variant_config(base, "table") == base
  g = overlap_probe.variant_config(base, "gm_g4")
  assert (g.grid_minor_dim.name, g.grid_tile_width) == ("M", 4)
  assert overlap_probe.variant_config(g, "gn").grid_minor_dim.name == "N"
  assert overlap_probe.variant_config(base, "pf").prefetch_tiles
  assert not overlap_probe.variant_config(base, "pf_nopf").prefetch_tiles
  # spread_stores runs with deferred signals (config.with_spread); "noss" leaves them as set.
  eager = dataclasses.replace(base, eager_signal_steps=1)
  ss = overlap_probe.variant_config(eager, "ss")
  assert ss.spread_stores and ss.eager_signal_steps == 0 and ss.fits_smem(2)
  noss = overlap_probe.variant_config(eager, "ss_noss")
  assert not noss.spread_stores and noss.eager_signal_steps == 0
  # Fitted at the D asked: a 4-step 128 x 256 pipeline fits at D = 1 only.
  s4 = overlap_probe.variant_config(base, "noadd_t128x128_s4", num_devices=1)
  assert s4.max_concurrent_steps == 4
  assert overlap_probe.variant_config(base, "noadd_t128x128_s4").max_concurrent_steps < 4
  r = overlap_probe.variant_config(base, "r6_s2_e32")
  assert (r.recv_stages, r.max_concurrent_steps, r.epi_tile_n) == (6, 2, 32) and r.fits_smem(2)
  # The D = 2 default already adds by TMA: "tadd" must turn it on from a config without it.
  no_add = dataclasses.replace(base, tma_add=False)
  tadd = overlap_probe.variant_config(no_add, "tadd")
  assert tadd.tma_add and tadd.numerics == "unfused_order" and tadd.fits_smem(2)
  wg_n = overlap_probe.variant_config(tadd, "wn")
  assert wg_n.wg_dimension.name == "N"
  noadd = overlap_probe.variant_config(wg_n, "t64x256_wm_noadd")
  assert not noadd.tma_add and noadd.wg_dimension.name == "M" and noadd.fits_smem(2)
  with pytest.raises(ValueError, match="unknown variant token"):
    overlap_probe.variant_config(base, "x9")


@pytest.mark.slow  # ~30 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_overlap_probe_plumbing(tmp_path):
  out = tmp_path / "probe.json"
  proc = helpers.run_script_with_stand_ins(
      "overlap_probe.py", ["--names=mixtral8x22b_o_proj_m512", "--proxy=",
                           "--variants=v1_bf16,c2_bf16", "--iterations=2", "--scale=4", f"--out={out}"],
      stand_ins=STAND_INS, after_load="mod.bench_env.require_gpu = lambda script, what: None",
      timeout=900)
  assert proc.returncode == 1, proc.stderr[-3000:]  # the one wrong case
  assert "checks: 1 of 10 failed" in proc.stdout, proc.stdout[-3000:]
  result = json.loads(out.read_text())
  checks = result["checks"]
  assert {(c["transport"], c["d"]) for c in checks} == {
      ("nvlink", 8), ("loopback", 2), ("loopback", 4), ("loopback", 8)}
  assert all("error" not in c for c in checks), [c.get("error") for c in checks]
  assert all(c["deterministic"] and not c["nan"] for c in checks)
  wrong = [c for c in checks if c["variant"] == "c2_bf16" and c["d"] == 8
           and c["transport"] == "loopback"]
  assert [(c["passed"], c["bits_equal_v1"]) for c in wrong] == [(False, False)]
  assert wrong[0]["ratio"] > 1.1
  assert all(c["passed"] and c.get("bits_equal_v1", True) for c in checks if c not in wrong)
  (row,) = result["rows"]
  assert row["d"] == 8
  assert set(row["times_us"]) == {"xla_gemm", "xla_comm", "xla_seq", "v1_bf16", "v1_bf16_nocomm",
                                  "c2_bf16", "c2_bf16_nocomm", "c2_bf16_nogemm",
                                  "c2_bf16_nogemm_stage_wait"}
  assert row["configs"]["c2_bf16"]["comm_ctas"] == 2
  rate = row["comm_gbps"]["c2_bf16"]  # From the stand-in's times: plumbing only.
  assert rate["bytes_per_gpu"] == 7 * (row["m"] // 8) * row["n"] * 2
  assert rate["per_comm_cta"] == pytest.approx(rate["total"] / 2)
  assert result["environment"]["jax_version"]
