"""experiments/compile_probe.py on CPU (--lower_only): the NVLink kernel of a config built for
D ranks on a one-device stand-in mesh and exported for CUDA; a config the kernel cannot take is
recorded, not fatal; the JSON names no running case once done."""
import json
import os
import subprocess
import sys

import helpers


def test_compile_probe_lower_only(tmp_path):
  out = tmp_path / "compile_probe.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(helpers.REPO))
  proc = subprocess.run(
      [sys.executable, str(helpers.REPO / "experiments" / "compile_probe.py"), "--lower_only",
       "--names=llama70b_o_proj_m2048", "--configs=t64x256_wm_noadd,t64x192_wm",
       f"--out={out}"], capture_output=True, text=True, timeout=300, env=env, cwd=helpers.REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(out.read_text())
  assert record["running"] is None
  ok, bad = record["rows"]
  assert (ok["config"], ok["d"], ok["k_shard"], ok["mosaic_gpu"]) == (
      "t64x256_wm_noadd", 2, 4096, True)
  assert "tma_add=False" in ok["config_repr"] and "wg_dimension=M" in ok["config_repr"]
  assert "not a multiple of the CTA tile's 192 columns" in bad["error"]  # n = 8192
  assert "compile s" in proc.stdout  # the table printed last
