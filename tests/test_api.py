"""Forward pass, dispatch and validation of pallas_rs.matmul_reduce_scatter (CPU)."""
import functools
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import pallas_rs
from pallas_rs.kernel import config as config_lib
from pallas_rs import api  # pylint: disable=unused-import
from pallas_rs.tuning import gate
from pallas_rs import platform
from pallas_rs import reference
from pallas_rs.bench import shapes
from pallas_rs.bench import testing

AXIS = helpers.AXIS
CI = shapes.select("ci")


def _seed(*parts) -> int:
  return zlib.crc32(repr(parts).encode())


def _dim1_ok(case):
  return case.n % case.num_devices == 0


@pytest.mark.parametrize(
    "case,scatter_dimension,implementation",
    [pytest.param(c, 0, impl, id=f"{c.name}-dim0-{impl}", marks=helpers.ci_marks(c))
     for c in CI for impl in ("xla", "auto")]
    + [pytest.param(c, 1, "xla", id=f"{c.name}-dim1-xla", marks=helpers.ci_marks(c))
       for c in CI if _dim1_ok(c)])
def test_forward_matches_numpy(case, scatter_dimension, implementation):
  mesh = helpers.make_mesh(case.num_devices)
  tol = helpers.forward_tolerance(case.dtype, case.num_devices)
  # Two calls with fresh inputs: a stale buffer or semaphore would show here.
  for call in range(2):
    inputs = testing.make_inputs(case, seed=_seed(case.name, call))
    x, w = testing.put_operands(inputs, mesh, AXIS)
    out = pallas_rs.row_parallel_matmul(
        x, w, mesh=mesh, axis_name=AXIS, scatter_dimension=scatter_dimension,
        implementation=implementation)
    assert out.dtype == np.dtype(helpers.np_dtype(case.dtype))
    ref = helpers.reference_output(inputs, scatter_dimension)
    # Shard i, as held by mesh device i, is chunk i of the reference.
    shards = helpers.per_device_shards(out, mesh)
    helpers.assert_close(shards, ref, tol=tol, name=f"{case.name} call {call}")
    if implementation != "xla":
      # Seed correctness rule: at most 1.1x the error of the XLA path.
      xla = pallas_rs.row_parallel_matmul(
          x, w, mesh=mesh, axis_name=AXIS, scatter_dimension=scatter_dimension,
          implementation="xla")
      err_xla = reference.max_rel_error(helpers.per_device_shards(xla, mesh), ref)
      err = reference.max_rel_error(shards, ref)
      assert err <= 1.1 * err_xla + 1e-7, (err, err_xla)


def test_exact_with_small_integers():
  # Small integers make every product and sum exact in bf16: atol = 0.
  case = shapes.by_name("ci_n96_d4")
  mesh = helpers.make_mesh(case.num_devices)
  rng = np.random.default_rng(0)
  inputs = testing.make_inputs(case)
  xs = rng.integers(-2, 3, inputs.xs.shape).astype(inputs.xs.dtype)
  ws = rng.integers(-1, 2, inputs.ws.shape).astype(inputs.ws.dtype)
  xs *= (np.arange(case.num_devices) + 1)[:, None, None].astype(xs.dtype)
  inputs = testing.Inputs(xs=xs, ws=ws, x=np.concatenate(list(xs), 1),
                          w=np.concatenate(list(ws), 0))
  x, w = testing.put_operands(inputs, mesh, AXIS)
  out = pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS)
  np.testing.assert_array_equal(
      helpers.per_device_shards(out, mesh).astype(np.float64),
      helpers.reference_output(inputs))


def test_negative_scatter_dimension_aliases():
  case = shapes.by_name("ci_n96_d4")
  mesh = helpers.make_mesh(case.num_devices)
  x, w = testing.put_operands(testing.make_inputs(case), mesh, AXIS)
  for neg, pos in ((-2, 0), (-1, 1)):
    a = pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS,
                                      scatter_dimension=neg)
    b = pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS,
                                      scatter_dimension=pos)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.spec == b.sharding.spec


def test_explicit_mesh_and_unsharded_inputs():
  case = shapes.by_name("ci_n320_d2")
  mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  inputs = testing.make_inputs(case)
  out = pallas_rs.row_parallel_matmul(jnp.asarray(inputs.x),
                                      jnp.asarray(inputs.w), mesh=mesh,
                                      axis_name=AXIS)
  helpers.assert_close(np.asarray(out).reshape(helpers.reference_output(
      inputs).shape), helpers.reference_output(inputs),
                       tol=helpers.forward_tolerance(case.dtype, 2))


# --- dispatch -----------------------------------------------------------------


def _call_fn(implementation, scatter_dimension=0):
  return functools.partial(pallas_rs.matmul_reduce_scatter, axis_name=AXIS,
                           implementation=implementation,
                           scatter_dimension=scatter_dimension)


@pytest.mark.skipif(platform.on_hopper(), reason="checks the CPU fallback")
def test_auto_on_cpu_uses_xla_and_warns_once(monkeypatch):
  logged = []
  monkeypatch.setattr(platform.logging, "info", lambda *a: logged.append(("i", a)))
  monkeypatch.setattr(platform.logging, "warning", lambda *a: logged.append(("w", a)))
  platform.reset_fallback_log()
  case = shapes.by_name("ci_min_m_d8")
  mesh = helpers.make_mesh(case.num_devices)
  x, w = testing.put_operands(testing.make_inputs(case), mesh, AXIS)
  auto = helpers.shard_mapped(_call_fn("auto"), mesh)(x, w)
  # A different shape retraces; the reason is the same, so no second log.
  case2 = shapes.by_name("ci_llama70b_o_proj_d8")
  x2, w2 = testing.put_operands(testing.make_inputs(case2), mesh, AXIS)
  helpers.shard_mapped(_call_fn("auto"), mesh)(x2, w2)
  # A shape the fused kernel would take still uses XLA off Hopper.
  case3 = shapes.by_name("ci_min_tile_d8")
  x3, w3 = testing.put_operands(testing.make_inputs(case3), mesh, AXIS)
  helpers.shard_mapped(_call_fn("auto"), mesh)(x3, w3)
  xla = helpers.shard_mapped(_call_fn("xla"), mesh)(x, w)
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
  assert len(logged) == 1, logged
  level, args = logged[0]
  assert level == "w" and "platform='cpu'" in args[1], logged


@pytest.mark.skipif(platform.on_hopper(), reason="checks the CPU fallback")
def test_fallback_reason_is_visible_by_default_once():
  # A plain script, no logging set up: the reason shows on stderr, once for two calls.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import jax, jax.numpy as jnp, pallas_rs\n"
          "mesh = jax.make_mesh((2,), ('x',), devices=jax.devices()[:2])\n"
          "x, w = jnp.ones((128, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)\n"
          "for m in (64, 128):\n"
          "  pallas_rs.row_parallel_matmul(x[:m], w, mesh=mesh, axis_name='x')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False, timeout=120, env=env, cwd=helpers.REPO)
  assert res.returncode == 0, res.stderr[-2000:]
  lines = [l for l in res.stderr.splitlines() if "pallas_rs: using the XLA path" in l]
  assert len(lines) == 1 and "platform='cpu'" in lines[0], res.stderr[-2000:]
  # The README quotes it as it is.
  readme = " ".join((helpers.REPO / "README.md").read_text().split())
  (quoted,) = re.findall(r"`(pallas_rs: using the XLA path: [^`]+)`", readme)
  assert lines[0].endswith(quoted), (lines[0], quoted)


def test_decide_on_cpu():
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  kw = dict(m=64, k_shard=64, n=128, dtype=jnp.bfloat16, num_devices=8,
            config=None)
  assert gate.decide("matmul_rs", **kw, implementation="xla") == ("xla", None, None)
  # "fused" (lowered for CUDA from here): the kernel's default config, checked once; a shape
  # the kernel cannot tile raises, saying why.
  with pytest.raises(NotImplementedError, match="below the smallest tile"):
    gate.decide("matmul_rs", **kw, implementation="fused")
  problem = dict(kw, m=1024)
  del problem["config"]
  impl, checked, reason = gate.decide("matmul_rs", **problem, implementation="fused")
  assert (impl, reason) == ("fused", None)
  assert checked == fused.CheckedConfig.of(fused.check_supported(**problem), **problem)
  dec = gate.decide("matmul_rs", **kw, dimension=1, implementation="auto")
  assert dec.implementation == "xla" and "scatter_dimension=1" in dec.fallback
  with pytest.raises(NotImplementedError, match="scatter_dimension=1"):
    gate.decide("matmul_rs", **kw, dimension=1, implementation="fused")
  with pytest.raises(ValueError, match="op='nccl' must be one of"):
    gate.decide("nccl", **kw)


def test_auto_on_hopper_falls_back_once_per_reason(monkeypatch):
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  logged = []
  monkeypatch.setattr(platform.logging, "info", lambda *a: logged.append(a))
  monkeypatch.setattr(platform.logging, "warning", lambda *a: logged.append(a))
  platform.reset_fallback_log()
  reasons = iter(["reason A", "reason A", "reason B"])

  def not_supported(**kw):
    assert set(kw) == {"m", "k_shard", "n", "dtype", "num_devices", "config"}
    raise NotImplementedError(next(reasons))

  monkeypatch.setattr(fused, "check_supported", not_supported)
  kw = dict(m=64, k_shard=64, n=128, dtype=jnp.bfloat16, num_devices=8,
            config=None, implementation="auto")
  for _ in range(3):
    dec = gate.decide("matmul_rs", **kw)
    assert dec.implementation == "xla"
    platform.log_fallback_once(dec.fallback)
  assert [a[1] for a in logged] == ["reason A", "reason B"]

  # A supported shape: with an explicit config "auto" honours it; without one, the tuning
  # table decides, and an unmeasured shape stays on XLA (never claim a win not measured).
  monkeypatch.setattr(fused, "check_supported", lambda **kw: kw.get("config"))
  chosen = config_lib.Config(tile_m=64, tile_n=64)  # fits m // 8 = 128 rows, n = 128
  dec = gate.decide("matmul_rs", **dict(kw, m=1024, config=chosen))
  assert (dec.implementation, dec.config.config, dec.fallback) == ("fused", chosen, None)
  dec = gate.decide("matmul_rs", **kw)
  assert dec.implementation == "xla" and "tuning" in dec.fallback

  def bad(**kw):
    raise ValueError("tile_m=64 must divide m=100")

  monkeypatch.setattr(fused, "check_supported", bad)
  with pytest.raises(ValueError, match="tile_m=64"):
    gate.decide("matmul_rs", **kw)


@pytest.mark.parametrize("case_name,errors,match", [
    # Shape the kernel cannot tile: NotImplementedError from
    # pallas_rs.kernel.fused.check_supported, before anything is lowered.
    ("ci_min_m_d2", NotImplementedError, r"1 rows is below the smallest tile \(64\)"),
    # Shape the kernel takes: lowering for the CPU backend raises
    # NotImplementedError in pallas_rs's terms (not Pallas's "Only interpret mode
    # is supported on CPU backend").
    ("ci_min_tile_d2", NotImplementedError,
     r"implementation='fused' runs a Mosaic GPU kernel, which needs a Hopper "
     r"GPU.*implementation='auto'.*'xla'"),
])
def test_fused_call_on_cpu_raises(case_name, errors, match):
  # Running, not lowering: lowering for CUDA from a CPU machine is
  # tests/test_lowering.py's job.
  if helpers.hopper_devices():
    pytest.skip("checks the CPU-only behaviour")
  case = shapes.by_name(case_name)
  mesh = helpers.make_mesh(case.num_devices)
  x, w = testing.put_operands(testing.make_inputs(case), mesh, AXIS)
  with pytest.raises(errors, match=match):
    jax.block_until_ready(
        helpers.shard_mapped(_call_fn("fused"), mesh)(x, w))


def test_fused_scatter_dimension_1_not_implemented():
  case = shapes.by_name("ci_min_m_d2")
  mesh = helpers.make_mesh(case.num_devices)
  x, w = testing.put_operands(testing.make_inputs(case), mesh, AXIS)
  with pytest.raises(NotImplementedError, match="scatter_dimension=1"):
    pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS,
                                  scatter_dimension=1, implementation="fused")


# --- validation ---------------------------------------------------------------

_M, _KS, _N = 8, 16, 24  # Per-device shapes of the validation cases (D = 4).
_AG = {"fn": pallas_rs.all_gather_matmul}  # A case of all_gather_matmul (lhs [2, 16]).


@pytest.mark.parametrize("x_shape,w_shape,dtypes,kw,match", [
    ((_M, _KS, 1), (_KS, _N), None, {}, r"rank 2.*x.shape=\(8, 16, 1\)"),
    ((_M, _KS), (_N,), None, {}, r"rank 2.*w.shape=\(24,\)"),
    ((_M, _KS), (_KS + 1, _N), None, {},
     r"contraction dimensions differ: x.shape=\(8, 16\) w.shape=\(17, 24\)"),
    ((_M, _KS), (_KS, _N), ("bfloat16", "float32"), {},
     r"same dtype.*x.dtype=dtype\(bfloat16\).*w.dtype=dtype\('float32'\)"),
    ((_M, _KS), (_KS, _N), ("int32", "int32"), {}, r"floating point.*int32"),
    ((6, _KS), (_KS, _N), None, {},
     r"m=6 must be divisible by the size of axis_name='x' \(num_devices=4\)"),
    ((_M, _KS), (_KS, 30), None, {"scatter_dimension": 1},
     r"n=30 must be divisible.*num_devices=4.*scatter_dimension=1"),
    ((_M, _KS), (_KS, _N), None, {"axis_name": "y"},
     r"unknown axis_name='y'.*inside jax.shard_map"),
    ((_M, _KS), (_KS, _N), None, {"scatter_dimension": 2},
     r"scatter_dimension=2 must be 0 \(rows\) or 1"),
    ((_M, _KS), (_KS, _N), None, {"implementation": "triton"},
     r"implementation='triton' must be one of \('auto', 'fused', 'xla'\)"),
    ((_M, _KS), (_KS, _N), None, {"scatter_dimension": 1.0}, r"scatter_dimension=1.0 must be 0"),
    ((_M, _KS), (_KS, _N), None, {"axis_name": [AXIS]}, r"axis_name=\['x'\] of matmul_reduce"),
    ((_M, _KS), (_KS, _N), None, {"axis_name": (AXIS, AXIS)}, r"axis_name=\('x', 'x'\) of matm"),
    ((_M, _KS), (_KS, _N), None, {"axis_name": ()}, r"axis_name=\(\) of matmul_reduce_scatter"),
    ((2, _KS), (_KS, _N), None, {**_AG, "gather_dimension": True}, r"gather_dimension=True must"),
    ((2, _KS), (_KS, _N), ("bfloat16", "int32"), _AG, r"same dtype.*rhs.dtype=dtype\('int32'\)"),
    ((2, _KS), (_KS, _N), None, {**_AG, "out_dtype": jnp.int32}, r"out_dtype must be floating"),
], ids=["x_rank", "w_rank", "k_mismatch", "dtype_mismatch", "int_dtype",
        "m_indivisible", "n_indivisible_dim1", "unknown_axis", "bad_scatter_dim",
        "bad_implementation", "float_scatter_dim", "axis_list", "axis_twice", "axis_empty",
        "ag_bool_gather_dim", "ag_rhs_int", "ag_out_dtype_int"])
def test_validation_errors(x_shape, w_shape, dtypes, kw, match):
  mesh = helpers.make_mesh(4)
  x_dtype, w_dtype = dtypes or ("bfloat16", "bfloat16")
  x = jnp.zeros(x_shape, helpers.np_dtype(x_dtype))
  w = jnp.zeros(w_shape, helpers.np_dtype(w_dtype))
  kw = {"axis_name": AXIS, **kw}
  fn = kw.pop("fn", pallas_rs.matmul_reduce_scatter)

  def body(x, w):
    return fn(x, w, **kw)

  # Validation runs at trace time: no compilation needed.
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=jax.P(),
                                 out_specs=jax.P(), check_vma=False), x, w)


def test_unknown_axis_outside_shard_map():
  with pytest.raises(ValueError, match=r"unknown axis_name='x'"):
    pallas_rs.matmul_reduce_scatter(jnp.zeros((8, 8)), jnp.zeros((8, 8)),
                                    axis_name="x")


@pytest.mark.parametrize("x_shape,w_shape,axis_name,match", [
    ((8, 16), (16, 8), "model",
     r"axis_name='model' is not an axis of the mesh.*\('x',\)"),
    ((8, 16), (16,), AXIS, r"rank 2.*\(16,\)"),
    ((8, 16), (12, 8), AXIS, r"contraction dimensions differ"),
    ((8, 18), (18, 8), AXIS, r"k=18 must be divisible.*num_devices=4"),
    ((8, 16), (16, 8), (AXIS, AXIS),
     r"axis_name=\('x', 'x'\) of row_parallel_matmul names a mesh axis more than once"),
    ((6, 16), (16, 8), AXIS, r"m=6 must be divisible.*x.shape=\(6, 16\) w.shape=\(16, 8\)"),
])
def test_row_parallel_validation(x_shape, w_shape, axis_name, match):
  mesh = helpers.make_mesh(4)
  with pytest.raises(ValueError, match=match):
    pallas_rs.row_parallel_matmul(jnp.zeros(x_shape), jnp.zeros(w_shape),
                                  mesh=mesh, axis_name=axis_name)


# --- first-hour errors --------------------------------------------------------


@pytest.mark.parametrize("x_shape,w_shape,match", [
    ((0, _KS), (_KS, _N), r"zero-size operands are not supported \(m=0\): got "
     r"x.shape=\(0, 16\) w.shape=\(16, 24\)"),
    ((_M, 0), (0, _N), r"zero-size operands are not supported \(k_shard=0\): got "
     r"x.shape=\(8, 0\) w.shape=\(0, 24\)"),
    ((_M, _KS), (_KS, 0), r"zero-size operands are not supported \(n=0\): got "
     r"x.shape=\(8, 16\) w.shape=\(16, 0\)"),
], ids=["m0", "k0", "n0"])
def test_zero_size_operands(x_shape, w_shape, match):
  mesh = helpers.make_mesh(4)
  x, w = jnp.zeros(x_shape, jnp.bfloat16), jnp.zeros(w_shape, jnp.bfloat16)
  for impl in ("auto", "xla", "fused"):
    body = functools.partial(pallas_rs.matmul_reduce_scatter, axis_name=AXIS,
                             implementation=impl)
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(),
                                   check_vma=False), x, w)
  # Global arrays: the same dimensions of x [m, k] and w [k, n].
  with pytest.raises(ValueError, match=match.replace("k_shard", "k")):
    pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS)


def test_python_lists_are_refused():
  mesh = helpers.make_mesh(4)
  x, w = [[1.0] * 16] * 8, [[1.0] * 8] * 16
  with pytest.raises(ValueError, match=r"^x must be a jax.Array or numpy array, got list"):
    pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS)
  with pytest.raises(ValueError, match=r"^w must be a jax.Array or numpy array, got list"):
    pallas_rs.row_parallel_matmul(np.ones((8, 16), np.float32), w, mesh=mesh, axis_name=AXIS)
  with pytest.raises(ValueError, match=r"^x must be a jax.Array or numpy array, got list"):
    pallas_rs.matmul_reduce_scatter(x, w, axis_name=AXIS)
  with pytest.raises(ValueError, match=r"^lhs must be a jax.Array or numpy array, got list"):
    pallas_rs.all_gather_matmul(x, w, AXIS)
  # numpy arrays are accepted.
  out = pallas_rs.row_parallel_matmul(np.ones((8, 16), np.float32), np.ones((16, 8), np.float32),
                                      mesh=mesh, axis_name=AXIS)
  np.testing.assert_array_equal(np.asarray(out), np.full((8, 8), 16.0, np.float32))


def test_mesh_none_is_refused():
  x, w = jnp.zeros((8, 16)), jnp.zeros((16, 8))
  with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh.*got mesh=None"):
    pallas_rs.row_parallel_matmul(x, w, mesh=None, axis_name=AXIS)
  with pytest.raises(ValueError, match=r"AbstractMesh of 4 devices but x lies on 1; pass the"):
    pallas_rs.row_parallel_matmul(x, w, mesh=helpers.make_mesh(4).abstract_mesh, axis_name=AXIS)


@pytest.mark.parametrize("config", [{"tile_m": 64}, "tile_m=64", 64])
def test_config_must_be_a_config(config):
  mesh = helpers.make_mesh(4)
  x, w = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 24), jnp.bfloat16)
  for impl in ("auto", "xla", "fused"):
    with pytest.raises(TypeError, match=r"config must be a pallas_rs.Config or None"):
      pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS,
                                    implementation=impl, config=config)
    with pytest.raises(TypeError, match=r"config of all_gather_matmul must be a jax .*TuningConf"):
      pallas_rs.all_gather_matmul(x, w, AXIS, implementation=impl, config=config)

  def body(x, w):
    return pallas_rs.matmul_reduce_scatter(x, w, axis_name=AXIS, config=config)

  with pytest.raises(TypeError, match=r"config must be a pallas_rs.Config or None"):
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(jax.P(None, AXIS), jax.P(AXIS)),
                                 out_specs=jax.P(AXIS), check_vma=False), x, w)


def test_unknown_keyword_of_row_parallel_matmul():
  mesh = helpers.make_mesh(4)
  with pytest.raises(TypeError, match=r"unexpected keyword arguments \['implmentation'\]"):
    pallas_rs.row_parallel_matmul(jnp.zeros((8, 8)), jnp.zeros((8, 8)), mesh=mesh,
                                  axis_name=AXIS, implmentation="xla")


def test_tuple_axis_name_spanning_two_mesh_axes():
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  case = shapes.custom_case(64, 24, 128, 8, "float32")
  inputs = testing.make_inputs(case)
  for impl in ("xla", "auto"):
    out = pallas_rs.row_parallel_matmul(inputs.x, inputs.w, mesh=mesh, axis_name=("dp", "tp"),
                                        implementation=impl)
    helpers.assert_close(np.asarray(out).reshape(8, 8, 24), helpers.reference_output(inputs),
                         tol=helpers.forward_tolerance("float32", 8))
  with pytest.raises(ValueError, match=r"axis_name=\('dp', 'model'\) is not an axis"):
    pallas_rs.row_parallel_matmul(inputs.x, inputs.w, mesh=mesh, axis_name=("dp", "model"))


def test_float64_is_refused():
  mesh = helpers.make_mesh(4)
  with jax.enable_x64(True):
    x, w = jnp.zeros((8, 16), jnp.float64), jnp.zeros((16, 8), jnp.float64)
    with pytest.raises(ValueError, match=r"float64 is not supported \(accumulation is float32\)"):
      pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS)


def test_tuning_reachable_after_import_pallas_rs():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import pallas_rs; print(pallas_rs.tuning.use_table.__name__, "
          "pallas_rs.tuning.ENV_VAR)")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False, timeout=120)
  assert res.stdout.split() == ["use_table", "PALLAS_RS_TUNING_TABLE"], res.stderr[-2000:]


def test_fused_on_a_gpu_that_is_not_hopper(monkeypatch):
  class FakeGpu:
    platform, device_kind, compute_capability = "gpu", "NVIDIA A100", "8.0"
  monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu()])
  with pytest.raises(NotImplementedError, match=r"needs one process driving Hopper GPUs.*"
                     r"'NVIDIA A100'.*use implementation='auto' or 'xla'"):
    gate.decide("matmul_rs", m=1024, k_shard=64, n=256, dtype=jnp.bfloat16, num_devices=8,
                implementation="fused")
