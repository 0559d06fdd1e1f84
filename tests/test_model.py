"""The sequence-parallel Llama-style block (pallas_rs.model) and the AG-matmul gate (CPU).

Tolerances (normwise, max|out - ref| / max|ref|, helpers.assert_close):
  * "auto" vs "xla": 0. On CPU "auto" resolves to the XLA path for both the
    row-parallel op and the AG-matmul, so the two programs are the same math;
    on Hopper this test is where fused numerics would show (then see
    helpers.forward_tolerance).
  * sharded f32 block vs the unsharded f32 reference (`model.reference_block`):
    FWD_TOL_F32 = 2e-5 and GRAD_TOL_F32 = 1e-4. Only the summation order differs
    (K split over D devices, then summed; attention per head group); measured
    errors are 2e-7 .. 6e-7 forward and backward, so the bounds leave ~30x
    (gradients pass through softmax and RMSNorm, hence the wider one). A wrong
    head, kv group, chunk or device layout is an O(1) error.
  * bf16 block vs the f32 reference: BF16_FWD_TOL = 3e-2: a few bf16
    roundings (u = 2^-8) per layer on order-1 activations through 7 matmuls.
"""
import functools
import json
import logging
import os
from pathlib import Path
import subprocess
import sys

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from pallas_rs.kernel import ag_matmul
from pallas_rs import api
from pallas_rs.tuning import gate
from pallas_rs import platform
from pallas_rs import model
from pallas_rs.bench import testing

AXIS = helpers.AXIS
REPO = Path(__file__).resolve().parents[1]
P = jax.sharding.PartitionSpec
FWD_TOL_F32 = 2e-5
GRAD_TOL_F32 = 1e-4
BF16_FWD_TOL = 3e-2
# Small, GQA (2 query heads per kv head), every head count divisible by 8.
DIMS = dict(hidden=64, heads=16, kv_heads=8, head_dim=8, ffn=128)
TOKENS = 32  # 4 tokens per device at D = 8.
_BLOCK_KW = dict(heads=DIMS["heads"], kv_heads=DIMS["kv_heads"])


def _setup(num_devices, dtype=jnp.float32, seed=0):
  mesh = helpers.make_mesh(num_devices)
  params = model.init_params(jax.random.key(seed), num_devices=num_devices,
                             dtype=dtype, **DIMS)
  h = testing.activations(seed + 1, TOKENS, DIMS["hidden"], dtype=dtype)
  return mesh, params, h


def _reference_loss(params, h):
  out = model.reference_block(params, h, **_BLOCK_KW)
  return jnp.mean(jnp.square(out.astype(jnp.float32)))


@functools.lru_cache(maxsize=None)
def _value_and_grad(mesh, implementation):
  loss = model.make_loss_fn(mesh, AXIS, implementation=implementation,
                            **_BLOCK_KW)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _assert_tree_close(out, ref, *, tol, name):
  names = list(model.BlockParams._fields) + ["h"]
  flat_out, flat_ref = jax.tree.leaves(out), jax.tree.leaves(ref)
  assert len(flat_out) == len(flat_ref) == len(names)
  for leaf_name, a, b in zip(names, flat_out, flat_ref):
    helpers.assert_close(a, b, tol=tol, name=f"{name} d{leaf_name}")


@pytest.mark.parametrize("num_devices", [2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_block_matches_unsharded_reference_and_xla(num_devices):
  mesh, params, h = _setup(num_devices)
  sharded = model.shard_params(params, mesh, AXIS)
  block = model.make_block_fn(mesh, AXIS, implementation="auto", **_BLOCK_KW)
  out = block(sharded, h)
  # Chunk d of the tokens lands on device d.
  assert out.sharding.is_equivalent_to(
      jax.NamedSharding(mesh, P(AXIS, None)), 2)
  ref = model.reference_block(params, h, **_BLOCK_KW)
  helpers.assert_close(out, ref, tol=FWD_TOL_F32, name="block forward")

  loss, grads = _value_and_grad(mesh, "auto")(sharded, h)
  ref_loss, ref_grads = jax.value_and_grad(_reference_loss,
                                           argnums=(0, 1))(params, h)
  np.testing.assert_allclose(loss, ref_loss, rtol=FWD_TOL_F32)
  _assert_tree_close(grads, ref_grads, tol=GRAD_TOL_F32, name="grad vs ref")

  xla_out = model.make_block_fn(mesh, AXIS, implementation="xla",
                                **_BLOCK_KW)(sharded, h)
  helpers.assert_close(out, xla_out, tol=0, name="auto vs xla forward")
  xla_loss, xla_grads = _value_and_grad(mesh, "xla")(sharded, h)
  assert float(loss) == float(xla_loss)
  _assert_tree_close(grads, xla_grads, tol=0, name="auto vs xla grad")


def test_block_bf16_close_to_f32_reference():
  mesh, params, h = _setup(8, dtype=jnp.bfloat16)
  out = model.make_block_fn(mesh, AXIS, **_BLOCK_KW)(
      model.shard_params(params, mesh, AXIS), h)
  assert out.dtype == jnp.bfloat16
  as_f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  ref = model.reference_block(as_f32(params), as_f32(h), **_BLOCK_KW)
  helpers.assert_close(out, ref, tol=BF16_FWD_TOL, name="bf16 block")


def test_sgd_steps_reduce_the_loss_identically():
  mesh, params, h = _setup(4)
  lr, steps = 0.5, 4

  def train(value_and_grad, params):
    losses = []
    for _ in range(steps):
      loss, (grads, _) = value_and_grad(params, h)
      losses.append(float(loss))
      params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return np.array(losses)

  sharded = model.shard_params(params, mesh, AXIS)
  auto = train(_value_and_grad(mesh, "auto"), sharded)
  xla = train(_value_and_grad(mesh, "xla"), sharded)
  ref = train(jax.jit(jax.value_and_grad(_reference_loss, argnums=(0, 1))),
              params)
  assert np.all(np.diff(auto) < 0), auto
  np.testing.assert_array_equal(auto, xla)
  # Errors compound over the steps: a few times the one-step gradient bound.
  np.testing.assert_allclose(auto, ref, rtol=4 * GRAD_TOL_F32)


def test_param_validation():
  with pytest.raises(ValueError, match="kv_heads=6 must be divisible"):
    model.init_params(jax.random.key(0), hidden=64, heads=12, kv_heads=6,
                      head_dim=8, ffn=128, num_devices=4)
  with pytest.raises(ValueError, match="heads=12 must be a multiple"):
    model.init_params(jax.random.key(0), hidden=64, heads=12, kv_heads=8,
                      head_dim=8, ffn=128, num_devices=4)
  mesh, params, _ = _setup(2)
  with pytest.raises(ValueError, match="num_devices=2"):
    model.shard_params(params, helpers.make_mesh(4), AXIS)
  with pytest.raises(ValueError, match="implementation='nccl'"):
    model.make_block_fn(mesh, AXIS, implementation="nccl", **_BLOCK_KW)(
        model.shard_params(params, mesh, AXIS),
        jnp.zeros((TOKENS, DIMS["hidden"])))


# ---------------------------------------------------------------------------
# The AG-matmul gate.
# ---------------------------------------------------------------------------

_GATE_KW = dict(m_shard=128, k=1024, n=1280, dtype=jnp.bfloat16,
                out_dtype=jnp.bfloat16, num_devices=8, gather_dimension=0)
# The same call in `gate.decide`'s terms (the tuning table's key: m gathered rows).
_DECIDE_KW = dict(m=128 * 8, k_shard=1024, n=1280, dtype=jnp.bfloat16,
                  out_dtype=jnp.bfloat16, num_devices=8, dimension=0)


@pytest.mark.skipif(platform.on_hopper(), reason="checks the CPU fallback")
def test_ag_matmul_falls_back_on_cpu_with_reason_logged_once(caplog):
  impl, config, reason = gate.decide("ag_matmul", **_DECIDE_KW, implementation="auto")
  assert (impl, config) == ("xla", None)
  assert "Hopper" in reason and "platform='cpu'" in reason, reason
  with pytest.raises(NotImplementedError, match="Hopper"):
    gate.decide("ag_matmul", **_DECIDE_KW, implementation="fused")

  platform.reset_fallback_log()
  caplog.set_level(logging.INFO, logger="absl")
  mesh = helpers.make_mesh(8)
  lhs, rhs = testing.generate(0, 64, 32, 48, dtype=jnp.float32)

  def body(lhs, rhs):
    return api.all_gather_matmul(lhs, rhs, AXIS)

  run = lambda: jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(AXIS, None), P()),
      out_specs=(P(), P()), check_vma=False))(lhs, rhs)
  out, gathered = run()
  run()  # A second trace: no second log line.
  np.testing.assert_allclose(out, jnp.dot(lhs, rhs,
                                          precision=lax.Precision.HIGHEST),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(gathered, lhs)
  lines = [r.getMessage() for r in caplog.records
           if "all_gather_matmul:" in r.getMessage()]
  assert len(lines) == 1 and "Hopper" in lines[0], lines


@pytest.mark.parametrize("change, match", [
    (dict(num_devices=2), r"all devices of the process.*num_devices=2"),
    (dict(num_devices=1, gather_dimension=0), "needs >= 2 devices"),
    (dict(gather_dimension=1), "gathers rows only"),
    (dict(dtype=jnp.float32, out_dtype=jnp.float32), "bf16/f16"),
    (dict(out_dtype=jnp.float32), "out_name='float32'"),
    (dict(m_shard=96), "m_shard=96 divisible by 64"),
    (dict(n=1280 + 64), "n=1344 divisible by 128"),
    (dict(k=1000), "k=1000 divisible by 64"),
])
def test_ag_matmul_gate_rules_as_if_on_hopper(monkeypatch, change, match):
  # Pretend to be one process driving 8 Hopper GPUs (8 forced CPU devices).
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  with pytest.raises(NotImplementedError, match=match):
    ag_matmul.check_supported(**{**_GATE_KW, **change})


def test_ag_matmul_gate_accepts_the_llama70b_shapes(monkeypatch):
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  # QKV (10 heads x 128 per device), gate/up (2 x 3584), and the row-parallel
  # backward's dx (k_shard = 1024, 3584), at M = 512 (m_shard 64) and 8192.
  for m_shard in (64, 1024):
    for n in (1280, 7168, 1024, 3584):
      config = ag_matmul.check_supported(**{**_GATE_KW, "m_shard": m_shard,
                                            "k": 8192, "n": n})
      assert config.tile_m == (128 if m_shard % 128 == 0 else 64)


@pytest.mark.slow  # ~20 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_model_bench_smoke_end_to_end(tmp_path):
  """experiments/model_bench.py --mode=smoke: runs, writes JSON, fused unavailable."""
  out = tmp_path / "model_smoke.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  res = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "model_bench.py"),
       "--mode=smoke", "--m=64", "--iterations=1", "--warmup=0",
       f"--out={out}"], capture_output=True, text=True, env=env, timeout=300,
      check=False)
  assert res.returncode == 0, res.stderr[-3000:]
  doc = json.loads(out.read_text())
  assert doc["environment"]["device_count"] == 8
  by_key = {(r["pass"], r["implementation"]): r for r in doc["records"]}
  assert set(by_key) == {(p, i) for p in ("forward", "forward_backward")
                         for i in ("xla", "no_comm", "fused", "auto")}
  for (pass_name, impl), r in by_key.items():
    if impl == "fused":  # No Hopper here: never timed, never faked.
      assert r["status"].startswith("unavailable: ") and r["timing"] is None
      continue
    assert r["status"] == "ok" and not r["performance_claims"], r
    assert r["timer"] == "host_wall_clock"
    if impl == "auto":
      assert r["check"]["max_rel_error"] == 0.0
      assert r["metrics"]["speedup_vs_xla"] > 0
      assert "Hopper" in r["resolved"]["qkv"], r["resolved"]
