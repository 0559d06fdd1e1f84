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


def test_sustained_load_refuses_a_cpu():
  with (helpers.parsed_script("sustained_load", []) as mod,
        pytest.raises(app.UsageError, match="needs a GPU")):
    mod.main(["sustained_load.py"])


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
