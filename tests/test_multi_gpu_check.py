"""The multi-GPU check script's own plumbing, on 8 CPU devices with the kernel replaced.

The fused kernel cannot run on a CPU, so the script's NVLink mode is driven with a stand-in
(the XLA reference, or a deliberately wrong one) to check the script itself: sharding, the
unfused baseline, the error rule, the trailing collective, the stress loop and the exit code.
"""
import json
import math

import pytest

import helpers

STAND_INS = """
import math
def stand_in(x, w, *, axis_name, num_devices, config=None, unverified=False):
  out = reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
  return out * {factor} if {factor} != 1 else out
fused.fused_matmul_reduce_scatter = stand_in
"""


def _run(tmp_path, factor):
  out = tmp_path / "mg.json"
  proc = helpers.run_script_with_stand_ins(
      "multi_gpu_check.py", ["--m=128", "--scale=64", "--stress_calls=4", f"--out={out}"],
      stand_ins=STAND_INS.format(factor=factor))
  return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow  # ~40 s per case on 2 CPU cores: the slow layer (tests/conftest.py).
@pytest.mark.parametrize("factor,expect_ok", [(1, True), (1.01, False), ("math.nan", False)])
def test_script_checks_what_it_runs(tmp_path, factor, expect_ok):
  proc, result = _run(tmp_path, factor)
  assert result is not None, proc.stderr[-2000:]
  rows = result["correctness"]
  assert {r["mode"] for r in rows} == {"nvlink"}
  assert sorted({r["d"] for r in rows}) == [2, 4, 8]
  assert len(rows) == 3 * 4
  assert all(r["ok"] for r in rows) is expect_ok, rows
  assert (result["stress"]["failures"] == 0) is expect_ok
  assert (proc.returncode == 0) is expect_ok, proc.stderr[-2000:]
  worst = result["stress"]["worst_ratio"]
  if factor == "math.nan":  # A NaN output is the worst ratio (NaN, or null in the JSON).
    assert worst is None or math.isnan(worst), worst


CONFIG_STAND_IN = """
def stand_in(x, w, *, axis_name, num_devices, config=None, unverified=False):
  # The case's config must be --variant's (t64x256_wm_noadd) on the shape's default.
  assert config is not None and (config.tile_m, config.tile_n) == (64, 256), config
  assert config.wg_dimension.name == "M" and not config.tma_add, config
  return reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
fused.fused_matmul_reduce_scatter = stand_in
"""

HANG_STAND_IN = """
import time
def stand_in(x, w, *, axis_name, num_devices, config=None, unverified=False):
  time.sleep(600)  # A kernel whose wait never completes.
fused.fused_matmul_reduce_scatter = stand_in
"""


def test_variant_reaches_the_kernel(tmp_path):
  out = tmp_path / "mg.json"
  proc = helpers.run_script_with_stand_ins(
      "multi_gpu_check.py", ["--m=512", "--scale=16", "--nk=8192x8192", "--stress_calls=2",
                             "--variant=t64x256_wm_noadd", f"--out={out}"],
      stand_ins=CONFIG_STAND_IN)
  result = json.loads(out.read_text())
  rows = result["correctness"]
  assert [(r["d"], r["n"], r["k"]) for r in rows] == [(2, 512, 512), (4, 512, 512), (8, 512, 512)]
  assert all(r["ok"] for r in rows), rows
  assert result["variant"] == "t64x256_wm_noadd" and result["running"] is None
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_hang_ends_the_run_and_names_the_case(tmp_path):
  out = tmp_path / "mg.json"
  proc = helpers.run_script_with_stand_ins(
      "multi_gpu_check.py", ["--m=512", "--scale=16", "--nk=8192x8192", "--case_timeout_s=5",
                             f"--out={out}"], stand_ins=HANG_STAND_IN, timeout=120)
  assert proc.returncode != 0
  assert "Timeout" in proc.stderr and "stand_in" in proc.stderr, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert result["correctness"] == []
  assert result["running"] == {"d": 2, "m": 512, "n": 512, "k": 512, "mode": "nvlink"}
