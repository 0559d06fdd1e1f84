"""experiments/kernel_check.py's verdict on CPU, with the kernel entry points replaced by
stand-ins (the XLA loopback reference, or a deliberately wrong one): the exit code and the
summary line say whether the checks it ran passed."""
import json

import pytest

import helpers

STAND_INS = """
def stand_in(xs, ws, *, config=None):
  out = reference.loopback_matmul_reduce_scatter(xs, ws)
  return out * {factor} if {factor} != 1 else out
fused.loopback_matmul_reduce_scatter = stand_in
"""
# --what=correct's cases include seed-sized GEMMs (minutes on a CPU): its per-case check is
# replaced by one that fails D = 4's cases, the rest of the run (rows, the NaN case, the
# verdict) as it is.
CHEAP_CHECK = """
mod.check = lambda d, m, n, k, seed, config=None: dict(d=d, m=m, n=n, k=k, ok=d != {bad_d})
"""


# Each script run ~7-9 s on 2 CPU cores: the passing runs in the slow layer, the failing ones
# (the checks bite and the exit code says so) in the fast layer.
@pytest.mark.parametrize("factor,expect_ok", [pytest.param(1, True, marks=pytest.mark.slow),
                                              (1.05, False)])
def test_stress_exit_code_follows_the_checks(tmp_path, factor, expect_ok):
  out = tmp_path / "kc.json"
  proc = helpers.run_script_with_stand_ins(
      "kernel_check.py", ["--what=stress", "--stress_calls=2", f"--out={out}"],
      stand_ins=STAND_INS.format(factor=factor), timeout=300)
  (row,) = json.loads(out.read_text())["rows"]
  assert (row["bad"] == 0) is expect_ok, row
  assert (proc.returncode == 0) is expect_ok, proc.stderr[-2000:]
  assert f"stress: {0 if expect_ok else 2} of 2 failed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("bad_d,expect_ok", [pytest.param(0, True, marks=pytest.mark.slow),
                                              (4, False)])
def test_correct_exit_code_follows_the_checks(tmp_path, bad_d, expect_ok):
  out = tmp_path / "kc.json"
  proc = helpers.run_script_with_stand_ins(
      "kernel_check.py", ["--what=correct", f"--out={out}"],
      stand_ins=STAND_INS.format(factor=1), after_load=CHEAP_CHECK.format(bad_d=bad_d),
      timeout=300)
  rows = json.loads(out.read_text())["rows"]
  assert rows[-1] == {"check": "nan", "ok": True}
  failed = sum(not r["ok"] for r in rows)
  assert (failed == 0) is expect_ok, rows
  assert (proc.returncode == 0) is expect_ok, proc.stderr[-2000:]
  assert f"correct: {failed} of {len(rows)} failed" in proc.stdout, proc.stdout[-2000:]
