"""The multi-GPU check script's own plumbing, on 8 CPU devices with the kernel replaced.

The fused kernel cannot run on a CPU, so the script's NVLink mode is driven with a stand-in
(the XLA reference, or a deliberately wrong one) to check the script itself: sharding, the
unfused baseline, the error rule, the trailing collective, the stress loop and the exit code.
"""
import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

REPO = Path(__file__).resolve().parents[1]

DRIVER = """
import importlib.util, sys
sys.path.insert(0, {repo!r})
from absl import app
from pallas_rs import fused, reference
def stand_in(x, w, *, axis_name, num_devices, config=None):
  out = reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
  return out * {factor} if {factor} != 1 else out
fused.fused_matmul_reduce_scatter = stand_in
spec = importlib.util.spec_from_file_location("mgc", {script!r})
mgc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mgc)
app.run(mgc.main)
"""


def _run(tmp_path, factor):
  out = tmp_path / "mg.json"
  code = DRIVER.format(repo=str(REPO), script=str(REPO / "experiments" / "multi_gpu_check.py"),
                       factor=factor)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run(
      [sys.executable, "-c", code, "--m=128", "--scale=64", "--stress_calls=4", f"--out={out}"],
      capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
  return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("factor,expect_ok", [(1, True), (1.01, False)])
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
