"""experiments/no_comm.py: the model benchmark's no-communication baseline (CPU).

A fair baseline does the same matmuls as the real block, forward and backward, and no
collective: checked on the compiled HLO (dot FLOPs counted from the instructions).
"""
import functools
from pathlib import Path
import sys

import jax
import jax.numpy as jnp
import pytest

import helpers
from pallas_rs import model
from pallas_rs.bench import testing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import no_comm  # pylint: disable=g-import-not-at-top,wrong-import-position

AXIS = helpers.AXIS
P = jax.sharding.PartitionSpec
DIMS = dict(hidden=256, heads=16, kv_heads=8, head_dim=16, ffn=512)
TOKENS = 64
_BLOCK_KW = dict(heads=DIMS["heads"], kv_heads=DIMS["kv_heads"], implementation="xla")


@functools.lru_cache(maxsize=None)
def _setup():
  mesh = helpers.make_mesh(8)
  params = model.shard_params(model.init_params(jax.random.key(0), num_devices=8,
                                                dtype=jnp.bfloat16, **DIMS), mesh, AXIS)
  h = testing.activations(1, TOKENS, DIMS["hidden"])
  return mesh, params, h


@functools.lru_cache(maxsize=None)
def _hlo(without, pass_name):
  mesh, params, h = _setup()
  fn = no_comm.block_functions(mesh, AXIS, without=without, **_BLOCK_KW)[pass_name]
  return fn.lower(params, h).compile().as_text()


def test_dot_flops_counts_a_known_matmul():
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  text = f.lower(jnp.zeros((32, 48), jnp.bfloat16), jnp.zeros((48, 80), jnp.bfloat16)
                 ).compile().as_text()
  assert no_comm.dot_flops(text) == 2 * 32 * 48 * 80


@pytest.mark.parametrize("pass_name", [
    "forward", pytest.param("forward_backward", marks=pytest.mark.slow)])
def test_no_comm_has_no_collectives_and_the_same_dot_flops(pass_name):
  real, local = _hlo((), pass_name), _hlo(no_comm.LAYERS, pass_name)
  # The real block: an all-gather and a reduce-scatter per layer pair, both passes.
  assert no_comm.collectives(real).count("all-gather") == (
      2 if pass_name == "forward" else 4), no_comm.collectives(real)
  assert no_comm.collectives(local) == []
  assert no_comm.dot_flops(real) == no_comm.dot_flops(local) > 0


# One column-parallel (qkv) and one row-parallel (o_proj) layer in the fast layer; the other
# two, the same replacements in another layer, in the slow layer (tests/conftest.py).
@pytest.mark.parametrize("layer", [
    pytest.param(layer, marks=pytest.mark.slow if layer in ("gate_up", "down_proj") else ())
    for layer in no_comm.LAYERS])
def test_one_layer_without_communication(layer):
  real = no_comm.collectives(_hlo((), "forward_backward"))
  one = no_comm.collectives(_hlo((layer,), "forward_backward"))
  # Each layer owns one all-gather and one reduce-scatter over forward + backward.
  assert len(one) == len(real) - 2, (real, one)
  assert no_comm.dot_flops(_hlo((layer,), "forward_backward")) == no_comm.dot_flops(
      _hlo((), "forward_backward"))


def test_no_comm_variant_has_the_block_shapes():
  mesh, params, h = _setup()
  out = no_comm.block_functions(mesh, AXIS, without=no_comm.LAYERS, **_BLOCK_KW)["forward"](
      params, h)
  assert out.shape == h.shape
  assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, P(AXIS, None)), 2)


def test_unknown_layer():
  with pytest.raises(ValueError, match=r"unknown layers \['wq'\]"):
    no_comm.layer_functions(["wq"])


@pytest.mark.slow  # ~20 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_model_bench_per_layer_smoke(tmp_path):
  """--per_layer: each layer's exposed communication of the XLA block is recorded."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  out = tmp_path / "model_smoke.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  res = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "model_bench.py"), "--mode=smoke",
       "--m=64", "--iterations=1", "--warmup=0", "--implementations=xla",
       "--passes=forward_backward", "--per_layer", f"--out={out}"],
      capture_output=True, text=True, env=env, timeout=300, check=False)
  assert res.returncode == 0, res.stderr[-3000:]
  doc = json.loads(out.read_text())
  assert doc["complete"] is True
  assert "m=64 forward_backward: " in res.stdout  # the progress line after each (m, pass)
  records = doc["records"]
  assert {r["implementation"] for r in records} == {
      "xla", "no_comm", *(f"no_comm_{layer}" for layer in no_comm.LAYERS)}
  (xla,) = [r for r in records if r["implementation"] == "xla"]
  assert set(xla["metrics"]["exposed_comm_by_layer_us"]) == set(no_comm.LAYERS)


NAN_GRAD_AFTER_LOAD = """
import jax, jax.numpy as jnp
_functions = mod._functions
def _nan_in_last_leaf(mesh, dims, variant):
  fns = _functions(mesh, dims, variant)
  if variant != "auto":
    return fns
  fb = fns["forward_backward"]
  def bad(params, h):  # Loss and output as "xla"'s, one gradient leaf NaN.
    leaves, tree = jax.tree.flatten(fb(params, h))
    return jax.tree.unflatten(tree, leaves[:-1] + [leaves[-1] * jnp.nan])
  return dict(fns, forward_backward=jax.jit(bad))
mod._functions = _nan_in_last_leaf
"""


@pytest.mark.slow  # ~20 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_model_bench_a_nan_gradient_fails_the_check(tmp_path):
  """A NaN in one gradient leaf (not the first) must fail the record's check, say so in the
  table and give exit code 1 (a max over the leaves must not drop the NaN)."""
  import json  # pylint: disable=g-import-not-at-top
  out = tmp_path / "model_smoke.json"
  proc = helpers.run_script_with_stand_ins(
      "model_bench.py", ["--mode=smoke", "--m=64", "--iterations=1", "--warmup=0",
                         "--implementations=xla,auto", "--passes=forward_backward",
                         f"--out={out}"], stand_ins="", after_load=NAN_GRAD_AFTER_LOAD)
  doc = json.loads(out.read_text())
  (auto,) = [r for r in doc["records"] if r["implementation"] == "auto"]
  assert auto["status"] == "ok", auto["status"]
  assert auto["check"]["passed"] is False, auto["check"]
  assert auto["check"]["max_rel_error"] is None  # NaN, written as null
  (row,) = [line for line in proc.stdout.splitlines() if " auto " in line]
  assert "CHECK FAILED" in row, proc.stdout[-2000:]
  assert proc.returncode == 1, proc.stderr[-2000:]


def test_model_bench_table_says_when_a_check_failed():
  """A record that ran ("ok") but failed its check against "xla" reads CHECK FAILED in the
  table, not ok."""
  with helpers.script("model_bench") as mod:
    rec = {"shape": {"m": 64, "num_devices": 8}, "pass": "forward", "implementation": "auto",
           "status": "ok", "timing": {"stats": {"median": 5.0}}, "metrics": None,
           "check": {"max_rel_error": 0.5, "tolerance": 3e-2, "passed": False}}
    good = dict(rec, implementation="xla", check=None)
    bad_row, good_row = mod.format_table([rec, good]).splitlines()[1:]
    assert bad_row.rstrip().endswith("CHECK FAILED"), bad_row
    assert good_row.rstrip().endswith("ok"), good_row
