"""experiments/sustained_load.py on CPU: its flag checks, its refusal without CUPTI, and the chain
it times (c <- c @ w, --steps times, in one call)."""
from absl import app
import numpy as np
import pytest

import helpers


@pytest.mark.parametrize("argv, match", [
    (["--steps=4,x"], "--steps: not a positive integer: 'x'"),
    (["--steps=4,0"], "--steps: not a positive integer: '0'"),
    (["--iterations=0"], "--iterations: not a positive integer: 0"),
    (["--k=-8"], "--k: not a positive integer: -8"),
    (["--functions=xla,cublas"], r"--functions: not one of \['xla', 'kernel'\]: 'cublas'"),
])
def test_sustained_load_flags(argv, match):
  with (helpers.parsed_script("sustained_load", argv) as mod,
        pytest.raises(app.UsageError, match=match)):
    mod.check_flags()


def test_the_chain_is_steps_gemms_in_one_call():
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  with helpers.parsed_script("sustained_load", ["--m=32", "--k=16"]) as mod:
    x, w = testing.generate(0, 32, 16, 16)  # what main times: x ~ N(0, 1), w ~ N(0, 1 / k)
    got = np.asarray(mod.chain("xla", 3)(x, w), np.float32)
    xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
    want = xf @ wf @ wf @ wf
    assert got.shape == (32, 16)
    # bf16 between the steps: within a few bf16 ulps of the fp32 chain, and far from 2 or 4 steps.
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 0.05 * scale
    for other in (xf @ wf @ wf, xf @ wf @ wf @ wf @ wf):
      assert np.abs(got - other).max() > 0.2 * scale
    # The chain keeps its scale (w ~ N(0, 1/k)): no overflow over long runs.
    assert 0.3 < np.std(got) / np.std(xf) < 3


def test_main_writes_both_chains_and_the_kernel_config(tmp_path, monkeypatch):
  # On CPU: the host timer instead of CUPTI, and XLA's dot standing in for the kernel (it cannot
  # run here); the record must name the config the kernel would run (2026-12-06's had none).
  import json  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  out = tmp_path / "sustained.json"
  monkeypatch.setattr(fused, "local_matmul", lambda c, w, config: jnp.dot(c, w))
  with helpers.parsed_script("sustained_load", ["--m=128", "--k=64", "--steps=2,3",
                                                "--iterations=2", f"--out={out}"]) as mod:
    monkeypatch.setattr(mod.bench_env, "require_cupti", lambda script: None)
    assert mod.main(["sustained_load.py"]) == 0
    want = repr(mod.kernel_config())
  doc = json.loads(out.read_text())
  assert doc["kernel_config"] == want and want.startswith("Config(")
  assert [(c["function"], c["steps"]) for c in doc["cases"]] == [
      ("xla", 2), ("kernel", 2), ("xla", 3), ("kernel", 3)]
  assert all(len(c["times_us"]) == 2 for c in doc["cases"])
