"""experiments/ablate.py's plumbing on 8 CPU devices, with the kernel replaced by a stand-in
(the fused kernel cannot run on a CPU): variants, baselines, the check, the JSON."""
import json
import os
from pathlib import Path
import subprocess
import sys

REPO = Path(__file__).resolve().parents[1]

DRIVER = """
import importlib.util, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {exp!r})
from absl import app
from pallas_rs import fused, reference
def stand_in(x, w, *, axis_name, num_devices, config=None, ablate=()):
  out = reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
  return out * 0 if ablate else out  # ablated variants are wrong by construction
fused.fused_matmul_reduce_scatter = stand_in
spec = importlib.util.spec_from_file_location("ablate", {script!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.require_gpu = lambda jax: None
app.run(mod.main)
"""


def test_ablate_script_plumbing(tmp_path):
  out = tmp_path / "ablate.json"
  code = DRIVER.format(repo=str(REPO), exp=str(REPO / "experiments"),
                       script=str(REPO / "experiments" / "ablate.py"))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run([sys.executable, "-c", code, "--names=llama70b_o_proj_m512",
                         "--iterations=2", f"--out={out}"],
                        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  (row,) = result["rows"]
  assert row["d"] == 8 and row["transport"] == "nvlink"
  assert set(row["times_us"]) == {"fused", "no_comm", "no_reduce", "no_comm_no_reduce",
                                  "xla_seq", "xla_gemm"}
  assert all(len(v) == 2 and min(v) > 0 for v in row["times_us"].values())
  assert row["fused_max_rel_error"] < 2.0**-7  # bf16 output of the stand-in
  assert result["environment"]["jax_version"]
