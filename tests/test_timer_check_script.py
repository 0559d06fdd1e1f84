"""experiments/timer_check.py on CPU: it refuses to run without CUPTI; with the refusal lifted,
its plumbing (two executables of one function, the three methods, the trace, the JSON and the
table) on the host timer, where its numbers mean nothing."""
import json

from absl import app
import pytest

import helpers


@pytest.mark.slow  # a subprocess with jax on 8 host devices: the slow layer (tests/conftest.py).
def test_timer_check_script_plumbing(tmp_path):
  out = tmp_path / "timer_check.json"
  proc = helpers.run_script_with_stand_ins(
      "timer_check.py", ["--names=ci_llama70b_o_proj_d2", "--num_devices=2",
                         "--functions=gemm,seq", "--repeats=2", "--iterations=4", "--rounds=2",
                         "--trace_calls=100", "--trace_session_calls=40",
                         "--session_limit_mib=3", "--ballast_mib=2", f"--out={out}"],
      stand_ins="", after_load="mod.bench_env.require_cupti = lambda script: None")
  assert proc.returncode == 0, proc.stderr[-3000:]
  doc = json.loads(out.read_text())
  rows = doc["rows"]
  assert doc["session_limit_bytes"] == 3 << 20
  assert doc["ballast_bytes_per_device"] == 2 << 20
  assert [(r["function"], r["num_devices"]) for r in rows] == [("gemm", 2), ("seq", 2)]
  for row in rows:
    assert set(row["methods"]) == {"block", "rounds", "interleaved"}
    for entry in row["methods"].values():
      assert len(entry["ratio"]) == 2 and all(r > 0 for r in entry["ratio"])
      assert len(entry["first_times_us"]["A"]) == 4
      # The clock each repeat ran at; here, with no nvidia-smi, why there is none.
      assert len(entry["clocks"]) == 2 and all(isinstance(c, (dict, str)) for c in entry["clocks"])
    assert len(row["trace_us"]) == 100 and row["trace_session_calls"] == 40  # 34 + 33 + 33
    assert row["output_bytes_per_call"] > 0 and "trace_clocks" in row
  assert "| ci_llama70b_o_proj_d2 | seq | interleaved |" in proc.stdout
  assert "trace 100 calls" in proc.stdout


def test_timer_check_flags():
  for argv, match in ((["--functions=seq"], "--functions=seq needs --num_devices >= 2"),
                      (["--functions=gemm,fused"],
                       "--functions=fused needs --num_devices >= 2"),
                      (["--functions=gemm,kernel", "--num_devices=2"],
                       "--functions=kernel runs on one GPU"),
                      (["--methods=blocks"], "--methods: not one of"),
                      (["--rounds=300"], "--rounds=300"),
                      (["--trace_calls=-2"], "--trace_calls: not an integer >= 0: -2"),
                      (["--trace_session_calls=-1"],
                       "--trace_session_calls: not an integer >= 0: -1"),
                      (["--session_limit_mib=-512"],
                       "--session_limit_mib: not an integer >= 0: -512"),
                      (["--ballast_mib=-1"], "--ballast_mib: not an integer >= 0: -1"),
                      (["--kernel_config=t64x192_bogus"], "--kernel_config")):
    with (helpers.parsed_script("timer_check", argv) as mod,
          pytest.raises(app.UsageError, match=match)):
      mod.check_flags()


def test_timer_check_fused_runs_the_kernel():
  # On a CPU the kernel refuses with its own message: "fused" is wired to it, not to XLA's path.
  with helpers.script("timer_check") as mod:
    fn, args = mod.build("ci_min_tile_d2", "fused", 2)  # m / D = 64 rows: the kernel's smallest.
    with pytest.raises(NotImplementedError, match="needs a Hopper GPU"):
      fn(*args)


def test_timer_check_kernel_takes_the_config_variant():
  import jax  # pylint: disable=g-import-not-at-top
  with helpers.parsed_script("timer_check", ["--kernel_config=t64x128_wn"]) as mod:
    fn, (x, w) = mod.build("ci_min_tile_d2", "kernel", 1)
  cfg = fn.__wrapped__.keywords["config"]
  assert (cfg.tile_m, cfg.tile_n, cfg.wg_dimension.name) == (64, 128, "N")
  assert x.shape == (128, 128) and w.shape == (128, 256)
  assert isinstance(x.sharding, jax.sharding.SingleDeviceSharding)  # Pallas needs unsharded.
