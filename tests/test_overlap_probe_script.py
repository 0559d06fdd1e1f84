"""experiments/overlap_probe.py's plumbing on 8 CPU devices, with the kernel replaced by a
stand-in (the fused kernel cannot run on a CPU): variant names, checks, timing rows, JSON."""
import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))

import overlap_probe  # pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_rs import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

DRIVER = """
import importlib.util, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {exp!r})
from absl import app
from pallas_rs import fused, reference
def stand_in(x, w, *, axis_name, num_devices, config=None, ablate=()):
  return reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
def stand_in_loopback(xs, ws, *, config=None, ablate=()):
  return reference.loopback_matmul_reduce_scatter(xs, ws)
fused.fused_matmul_reduce_scatter = stand_in
fused.loopback_matmul_reduce_scatter = stand_in_loopback
spec = importlib.util.spec_from_file_location("overlap_probe", {script!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.require_gpu = lambda jax: None
app.run(mod.main)
"""


def test_variant_names():
  base = config_lib.default_config(m=8192, n=8192, k_shard=4096, num_devices=2)
  assert overlap_probe.variant_config(base, "v1") == base
  c4 = overlap_probe.variant_config(base, "c4_bf16")
  assert (c4.comm_ctas, c4.partial_dtype, c4.epi_tile_n) == (4, "bfloat16", 64)
  o4 = overlap_probe.variant_config(base, "o4_bf16")
  assert o4.num_out_slots == 4 and o4.fits_smem(2)
  assert overlap_probe.variant_config(base, "o4").partial_dtype == "float32"
  with pytest.raises(ValueError, match="unknown variant token"):
    overlap_probe.variant_config(base, "x9")


def test_overlap_probe_plumbing(tmp_path):
  out = tmp_path / "probe.json"
  code = DRIVER.format(repo=str(REPO), exp=str(REPO / "experiments"),
                       script=str(REPO / "experiments" / "overlap_probe.py"))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run([sys.executable, "-c", code, "--names=mixtral8x22b_o_proj_m512",
                         "--proxy=", "--variants=v1,c2_bf16", "--iterations=2", "--scale=4",
                         f"--out={out}"],
                        capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  checks = result["checks"]
  assert {(c["transport"], c["d"]) for c in checks} == {
      ("nvlink", 8), ("loopback", 2), ("loopback", 4), ("loopback", 8)}
  assert all("error" not in c for c in checks), [c.get("error") for c in checks]
  assert all(c["deterministic"] and not c["nan"] for c in checks)
  assert all(c["bits_equal_v1"] for c in checks if c["variant"] == "c2_bf16")
  (row,) = result["rows"]
  assert row["d"] == 8
  assert set(row["times_us"]) == {"xla_gemm", "xla_comm", "xla_seq", "v1", "v1_nocomm",
                                  "c2_bf16", "c2_bf16_nocomm"}
  assert row["configs"]["c2_bf16"]["comm_ctas"] == 2
  assert result["environment"]["jax_version"]
