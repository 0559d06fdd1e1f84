"""experiments/gemm_core.py's plumbing on CPU, with the Mosaic GPU kernels replaced by stand-ins
(they cannot run on a CPU): config variants, the jax TuningConfig tokens, the check, the JSON."""
import json

import pytest

import helpers

STAND_INS = """
def local_stand_in(x, w, *, config=None):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
import jax.numpy as jnp
fused.local_matmul = local_stand_in
"""
AFTER_LOAD = """
mod.bench_env.require_gpu = lambda script, what: None
import jax.numpy as jnp
mod.jax_matmul = lambda hm, cfg: (
    lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
"""


def _run(tmp_path, jax_configs, stand_ins, extra=(), ours="table,t64x256_wm,t64x128"):
  """gemm_core.py on Mixtral o_proj at D = 8, M = 512 with our table / t64x256_wm / t64x128
  configs and `jax_configs`: (the process, its one JSON row)."""
  out = tmp_path / "gemm_core.json"
  proc = helpers.run_script_with_stand_ins(
      "gemm_core.py", ["--projections=mixtral8x22b_o_proj", "--ms=512", "--ds=8",
                       f"--ours={ours}", f"--jax={jax_configs}",
                       "--iterations=2", f"--out={out}", *extra],
      stand_ins=stand_ins, after_load=AFTER_LOAD)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  return proc, row


@pytest.mark.slow  # ~6 s on 2 CPU cores: the slow layer (tests/conftest.py), like ablate's.
def test_gemm_core_script_plumbing(tmp_path):
  # (A variant equal to the base is dropped as the same kernel: the default at D = 8, M = 512
  # is 128 x 128 warpgroup tiles along N (pairs), so the variants here are others.)
  proc, row = _run(tmp_path, "64x192_M_-,128x128_N_M", STAND_INS, ["--xla=plain"])
  assert (row["name"], row["d"], row["k_shard"], row["n"]) == ("mixtral8x22b_o_proj_m512", 8,
                                                                 768, 6144)
  assert "wg_dimension=M" in row["configs"]["ours:t64x256_wm"]
  assert "tile_n=256" in row["configs"]["ours:t64x256_wm"]
  assert "cluster_dimension=M" in row["configs"]["jax:128x128_N_M"]
  assert set(row["times_us"]) == {"xla_dot", "xla_dot:plain", "ours:table", "ours:t64x256_wm",
                                  "ours:t64x128", "jax:64x192_M_-", "jax:128x128_N_M"}
  assert set(row["kernels"]) == set(row["times_us"])  # None on a CPU: no CUPTI
  assert " plain=" in proc.stdout  # the form's time / XLA's in the table
  assert all(len(v) == 2 for v in row["times_us"].values())
  assert max(row["max_rel_error"].values()) < 2.0**-7
  assert "bad err" in proc.stdout  # the table printed last


WRONG_FAST_STAND_IN = """
import jax.numpy as jnp
def local_stand_in(x, w, *, config=None):
  if config.tile_n == 256:  # t64x256_wm: fast and wrong.
    return jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
fused.local_matmul = local_stand_in
"""


@pytest.mark.slow  # ~6 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_gemm_core_best_is_never_a_config_that_failed_its_check(tmp_path):
  proc, row = _run(tmp_path, "64x192_M_-", WRONG_FAST_STAND_IN)
  assert row["max_rel_error"]["ours:t64x256_wm"] == 1.0  # all zeros
  # It is the fastest of ours (zeros), and the table must not call it the best.
  med = {k: sorted(v)[0] for k, v in row["times_us"].items() if k.startswith("ours:")}
  assert min(med, key=med.get) == "ours:t64x256_wm", med
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("mixtral8x22b_o_proj_m512 ")
             and "D=" not in ln]
  assert "t64x256_wm" not in line, line
  assert line.split()[-2:] == ["1", "0"], line  # bad err, failed


ABLATING_STAND_IN = """
import jax.numpy as jnp
def local_stand_in(x, w, *, config=None, ablate=()):
  if ablate:  # the mainloop alone: the output is never written (zeros here)
    return jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
fused.local_matmul = local_stand_in
"""


@pytest.mark.slow  # ~6 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_gemm_core_ablated_variants_are_timed_not_judged(tmp_path):
  proc, row = _run(tmp_path, "64x192_M_-", ABLATING_STAND_IN, ["--ablations=store,store+gemm"],
                   ours="table,t64x256_wm,nopf")
  ablated = {"ours:table:nostore", "ours:table:nostore+gemm", "ours:t64x256_wm:nostore"}
  assert "ours:nopf" in row["max_rel_error"]  # a variant named "no...", checked as any other
  assert ablated <= set(row["times_us"]), sorted(row["times_us"])
  assert not ablated & set(row["max_rel_error"])  # wrong by design: not checked
  assert max(row["max_rel_error"].values()) < 2.0**-7  # (so nothing counts as a bad error)
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("mixtral8x22b_o_proj_m512 ")
             and "D=" not in ln]
  assert ":no" not in line.split()[3], line  # never the best of ours
  assert "table:nostore=" in line, line


def test_gemm_core_rejects_an_unknown_ablation(tmp_path):
  proc = helpers.run_script_with_stand_ins(
      "gemm_core.py", ["--ablations=mainloop", f"--out={tmp_path / 'g.json'}"],
      stand_ins=STAND_INS, after_load=AFTER_LOAD)
  assert proc.returncode != 0 and "mainloop" in proc.stderr, proc.stderr[-2000:]


PINGPONG_STAND_IN = """
import jax.numpy as jnp
def local_stand_in(x, w, *, config=None):
  if config.pingpong and config.max_concurrent_steps == 3:  # fast and wrong
    return jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
fused.local_matmul = local_stand_in
"""


@pytest.mark.slow  # ~6 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_gemm_core_pingpong_variants(tmp_path):
  # The `pp` variants are ours with the ping-pong body; the table's "best pp" column picks among
  # them (the wrong one dropped), "best ours" among the others.
  proc, row = _run(tmp_path, "", PINGPONG_STAND_IN,
                   ours="t64x256_wm,t128x128_s5_pp_gm_g8,t128x128_s3_pp")
  assert "pingpong=True" in row["configs"]["ours:t128x128_s5_pp_gm_g8"]
  assert "grid_minor_dim=M, grid_tile_width=8" in row["configs"]["ours:t128x128_s5_pp_gm_g8"]
  assert "pingpong=False" in row["configs"]["ours:t64x256_wm"]
  assert row["max_rel_error"]["ours:t128x128_s3_pp"] == 1.0  # checked like the others
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("mixtral8x22b_o_proj_m512 ")
             and "D=" not in ln]
  cells = line.split()
  assert "best pp" in proc.stdout and cells[3] == "t64x256_wm", line
  assert "t128x128_s5_pp_gm_g8" in cells[4:] and "s3_pp" not in line, line
  assert cells[-2:] == ["1", "0"], line  # bad err, failed
