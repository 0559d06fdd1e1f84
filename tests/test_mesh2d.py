"""The fused path on one axis of a multi-axis mesh (issue 21), on 8 forced CPU devices.

The kernel cannot run here, so its peers are checked where they are decided: in the lowered
Mosaic GPU module (every remote ref and remote semaphore's device id, evaluated for every device
of the mesh) and in a pure-Python model of `NVLinkTransport._device_id` through jax's own
dict -> device id mapping. A wrong-peer id is shown to fail both checks, and on the XLA path a
cross-group exchange is shown to fail the numerical check when each data-parallel group has its
own data. Then the public API, its gate ("auto" looks the tuning table up by the size of the
reduced axis; what it cannot run falls back with the reason) and the custom VJP on a 2-D mesh.
"""
import contextlib
import functools
import operator
import re

import jax
from jax import lax
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import launch_context
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import pallas_rs
from pallas_rs.kernel import defaults
from pallas_rs.kernel import fused
from pallas_rs.tuning import gate
from pallas_rs import platform
from pallas_rs import reference
from pallas_rs.bench import testing
from pallas_rs.kernel import transport
from pallas_rs import tuning

EXPLICIT = jax.sharding.AxisType.Explicit


def _mesh(shape, names, devices=None):
  return jax.make_mesh(shape, names, axis_types=(EXPLICIT,) * len(shape),
                       devices=devices or jax.devices()[:int(np.prod(shape))])


def _specs(names, axis):
  """x [groups * m, k] (rows by group: data parallel; k by `axis`), w [k, n] (k by `axis`),
  out [groups * m, n] (row chunk `axis_index` of each group's product, group by group)."""
  others = tuple(name for name in names if name != axis)
  return P(others, axis), P(axis, None), P((*others, axis), None)


# --- peers in the lowered module --------------------------------------------------------

_BINARY = {
    "arith.addi": operator.add, "arith.subi": operator.sub, "arith.muli": operator.mul,
    "arith.divsi": operator.floordiv, "arith.divui": operator.floordiv,
    "arith.remsi": operator.mod, "arith.remui": operator.mod, "arith.andi": operator.and_,
    "arith.ori": operator.or_, "arith.shli": operator.lshift, "arith.shrsi": operator.rshift,
    "arith.shrui": operator.rshift,
}
_CASTS = ("arith.trunci", "arith.extsi", "arith.extui", "arith.index_cast",
          "arith.index_castui")


def _evaluate(value, device: int) -> int:
  """The integer `value` (an MLIR value built from the device's own id) on device `device`.

  Peer ids are arith ops on the device id (Mosaic GPU re-derives them on the host for TMA
  descriptors, which allows nothing else), so a small interpreter of those ops suffices; the
  values are small and non-negative, where signed and unsigned division agree."""
  op = value.owner
  op = getattr(op, "operation", op)
  if launch_context.DEVICE_ID_ATTR in op.attributes:
    return device
  if op.name == "arith.constant":
    return ir.IntegerAttr(op.attributes["value"]).value
  args = [_evaluate(v, device) for v in op.operands]
  assert all(a >= 0 for a in args), (op.name, args)
  if op.name in _BINARY:
    return _BINARY[op.name](*args)
  if op.name in _CASTS:
    return args[0]
  raise AssertionError(f"peer id computed with {op.name}, which this model does not evaluate")


@contextlib.contextmanager
def captured_peers(num_devices: int):
  """Records, for each remote ref or remote semaphore the lowering creates (device and host
  side), its peer on every device 0 .. num_devices - 1 (linear ids in the mesh)."""
  tables = []
  to_remote = launch_context.LaunchContext.to_remote

  def recording(self, ref, peer, **kw):
    tables.append(tuple(_evaluate(peer, g) for g in range(num_devices)))
    return to_remote(self, ref, peer, **kw)

  launch_context.LaunchContext.to_remote = recording
  try:
    yield tables
  finally:
    launch_context.LaunchContext.to_remote = to_remote


def check_peers(tables, shape, names, axis) -> None:
  """Every remote access targets, from each device, the device `o` steps further along `axis`
  in the caller's group (the same coordinates on every other axis), for a fixed static
  offset o; together they cover o = 1 .. D - 1. AssertionError saying where otherwise."""
  ax, size = names.index(axis), int(np.prod(shape))
  d = shape[ax]

  def shifted(g, o):
    coords = list(np.unravel_index(g, shape))
    coords[ax] = (coords[ax] + o) % d
    return int(np.ravel_multi_index(coords, shape))

  assert tables, "no remote access was lowered"
  offsets = set()
  for table in tables:
    matches = [o for o in range(1, d) if all(table[g] == shifted(g, o) for g in range(size))]
    assert matches, (f"a remote access targets {dict(enumerate(table))} (device -> peer): not "
                     f"a fixed offset along {axis!r} within the caller's group, mesh "
                     f"{dict(zip(names, shape))}")
    offsets.add(matches[0])
  assert offsets == set(range(1, d)), (offsets, d)


def _export_fused(shape, names, axis, *, m=None, k_shard=256, n=512):
  """The fused kernel under shard_map over all axes, exported for CUDA; returns the peer
  tables of its remote accesses."""
  mesh = _mesh(shape, names)
  d = mesh.shape[axis]
  m = m or 128 * d
  x_spec, w_spec, out_spec = _specs(names, axis)
  f = functools.partial(fused.fused_matmul_reduce_scatter, axis_name=axis, num_devices=d)
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec,
                            check_vma=False))
  groups = mesh.size // d
  x = jax.ShapeDtypeStruct((groups * m, d * k_shard), jnp.bfloat16,
                           sharding=NamedSharding(mesh, x_spec))
  w = jax.ShapeDtypeStruct((d * k_shard, n), jnp.bfloat16, sharding=NamedSharding(mesh, w_spec))
  with captured_peers(mesh.size) as tables:
    exported = jax.export.export(g, platforms=["cuda"])(x, w)
  assert "mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (groups * m, n)
  return tables


MESHES = [
    pytest.param((2, 4), ("dp", "tp"), "tp", id="dp2_tp4"),
    pytest.param((4, 2), ("dp", "tp"), "tp", id="dp4_tp2"),
    pytest.param((4, 2), ("tp", "dp"), "tp", id="tp4_dp2_reduced_first"),
    pytest.param((2, 2, 2), ("a", "b", "c"), "a", id="2x2x2_reduced_first"),
    pytest.param((2, 2, 2), ("a", "b", "c"), "b", id="2x2x2_reduced_middle"),
    pytest.param((2, 2, 2), ("a", "b", "c"), "c", id="2x2x2_reduced_last"),
]


@pytest.mark.parametrize("shape,names,axis", MESHES)
def test_fused_lowers_and_addresses_peers_in_the_group(shape, names, axis):
  tables = _export_fused(shape, names, axis)
  check_peers(tables, shape, names, axis)


def test_wrong_peer_ids_are_caught_in_the_lowered_module(monkeypatch):
  """The failure the issue's probe found (a scalar LOGICAL id targets dp = 0), written as mesh
  coordinates: the same kernel lowers, and `check_peers` rejects it."""
  def dp0(self, rank, offset):
    return {"dp": 0, self.axis_name: lax.rem(rank + offset, self.num_devices)}

  monkeypatch.setattr(transport.NVLinkTransport, "_device_id", dp0)
  tables = _export_fused((2, 4), ("dp", "tp"), "tp")
  with pytest.raises(AssertionError, match="not a fixed offset along 'tp' within the caller's"):
    check_peers(tables, (2, 4), ("dp", "tp"), "tp")


def test_scalar_device_id_does_not_lower_on_a_2d_mesh(monkeypatch):
  """Why the transport names the axis: a bare scalar is a position on the whole mesh."""
  monkeypatch.setattr(transport.NVLinkTransport, "_device_id",
                      lambda self, rank, offset: lax.rem(rank + offset, self.num_devices))
  with pytest.raises(ValueError, match="Number of device ids must match the number of mesh"):
    _export_fused((2, 4), ("dp", "tp"), "tp")


@pytest.mark.parametrize("d", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_1d_mesh_lowers_to_the_same_module_as_the_scalar_id(monkeypatch, d):
  """The dict id is used everywhere because on a 1-D mesh the kernel's Mosaic GPU module (debug
  locations aside) is identical to the scalar id's, the one run on two H200s."""
  modules = helpers.record_kernel_modules(monkeypatch)
  tables = _export_fused((d,), ("x",), "x")
  check_peers(tables, (d,), ("x",), "x")
  monkeypatch.setattr(transport.NVLinkTransport, "_device_id",
                      lambda self, rank, offset: lax.rem(rank + offset, self.num_devices))
  _export_fused((d,), ("x",), "x")
  assert len(modules) == 2 and modules[0] == modules[1]


# --- peers in a pure-Python model ----------------------------------------------------------


def _model_peer(device_id, shape, names, coords, id_type="MESH"):
  """The linear device a remote call with `device_id` targets from the device at `coords`: jax's
  own mapping (Pallas' `device_id_to_logical`), a dict's missing axes filled with the caller's
  coordinates."""
  from jax._src.pallas import primitives as pallas_primitives  # pylint: disable=g-import-not-at-top
  from jax._src.pallas import utils as pallas_utils  # pylint: disable=g-import-not-at-top
  info = pallas_utils.MeshInfo(tuple(shape), tuple(names),
                               pallas_utils.strides_from_shape(tuple(shape)))
  logical, extra = pallas_primitives.device_id_to_logical(
      info, device_id, pallas_primitives.DeviceIdType[id_type], lambda name: coords[name])
  assert not extra
  return int(logical)


def assert_peers_in_group(device_id_fn, shape, names, axis="tp", id_type="MESH") -> None:
  """From every device, `device_id_fn(rank, o)` for o = 1 .. D - 1 (rank: the device's index
  along `axis`) must name exactly the other devices of its group (same coordinates on every
  other axis). AssertionError naming the first device that leaves it."""
  d = dict(zip(names, shape))[axis]
  for g in range(int(np.prod(shape))):
    coords = dict(zip(names, (int(c) for c in np.unravel_index(g, shape))))
    peers = [_model_peer(device_id_fn(coords[axis], o), shape, names, coords, id_type)
             for o in range(1, d)]
    group = {h for h in range(int(np.prod(shape)))
             if all(int(c) == coords[n] for n, c in zip(names, np.unravel_index(h, shape))
                    if n != axis)}
    assert sorted(peers) == sorted(group - {g}), (
        f"device {g} {coords} reaches {peers}; its group along {axis!r} is {sorted(group)}")


ORDERS = [((2, 4), ("dp", "tp")), ((4, 2), ("dp", "tp")), ((4, 2), ("tp", "dp")),
          ((2, 4), ("tp", "dp")), ((2, 2, 2), ("dp", "tp", "pp"))]


@pytest.mark.parametrize("shape,names", ORDERS)
def test_device_id_model_stays_in_the_group(shape, names):
  nvlink = transport.NVLinkTransport("tp", dict(zip(names, shape))["tp"])
  assert_peers_in_group(nvlink._device_id, shape, names)  # pylint: disable=protected-access


@pytest.mark.parametrize("shape,names", ORDERS[:4])
def test_device_id_model_catches_a_scalar_logical_id(shape, names):
  """The issue's wrong peer: the scalar rank `(tp + o) % D` read as a LOGICAL (linear) id."""
  d = dict(zip(names, shape))["tp"]
  with pytest.raises(AssertionError, match="its group along 'tp'"):
    assert_peers_in_group(lambda rank, o: (rank + o) % d, shape, names, id_type="LOGICAL")


# --- the numerical check sees a cross-group exchange -----------------------------------------

G, D, M, K_SHARD, N = 2, 4, 64, 32, 48


def _grouped_inputs(seed=0, dtype=jnp.float32, same_groups=False):
  """Global x [G * M, D * K_SHARD] (group g's rows: its own data), w [D * K_SHARD, N] on a
  (dp, tp) = (G, D) mesh, and the float64 expected output x @ w (group by group, row chunk by
  row chunk: exactly the out spec's layout)."""
  x, w = (np.asarray(a) for a in testing.generate(seed, G * M, D * K_SHARD, N, num_devices=D,
                                                   dtype=dtype))
  if same_groups:
    x = np.concatenate([x[:M]] * G)
  return x, w, x.astype(np.float64) @ w.astype(np.float64)


def _run_grouped(body, x, w, mesh, check_vma=False):
  x_spec, w_spec, out_spec = _specs(mesh.axis_names, "tp")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec,
                            check_vma=check_vma))
  return np.asarray(f(jax.device_put(x, NamedSharding(mesh, x_spec)),
                      jax.device_put(w, NamedSharding(mesh, w_spec))))


def _partial(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _reference(x, w):
  return reference.matmul_reduce_scatter(x, w, axis_name="tp")


def _summed_across_groups(x, w):  # peers in every group: the other group's partials added
  return lax.psum_scatter(lax.psum(_partial(x, w), "dp"), "tp", scatter_dimension=0, tiled=True)


def _other_groups_result(x, w):  # peers all in the other group: its result instead of ours
  swapped = lax.ppermute(_partial(x, w), "dp", [(i, (i + 1) % G) for i in range(G)])
  return lax.psum_scatter(swapped, "tp", scatter_dimension=0, tiled=True)


def test_cross_group_exchange_fails_the_check():
  mesh = _mesh((G, D), ("dp", "tp"))
  tol = helpers.forward_tolerance("float32", D)
  x, w, want = _grouped_inputs()
  helpers.assert_close(_run_grouped(_reference, x, w, mesh), want, tol=tol, name="right")
  for wrong in (_summed_across_groups, _other_groups_result):
    with pytest.raises(AssertionError, match="elements off by more than"):
      helpers.assert_close(_run_grouped(wrong, x, w, mesh), want, tol=tol, name=wrong.__name__)
  # Why the groups get distinct data: with the same data in every group, a wrong-group peer
  # computes the same numbers and the check cannot see it.
  x, w, want = _grouped_inputs(same_groups=True)
  helpers.assert_close(_run_grouped(_other_groups_result, x, w, mesh), want, tol=tol,
                       name="invisible with identical groups")


# --- the public API on a 2-D mesh ----------------------------------------------------------


@pytest.mark.parametrize("implementation", ["xla", "auto"])
@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")])
def test_api_forward_on_a_2d_mesh(implementation, names):
  mesh = _mesh((G, D) if names[0] == "dp" else (D, G), names)
  x, w, want = _grouped_inputs(seed=1, dtype=jnp.bfloat16)
  body = functools.partial(pallas_rs.matmul_reduce_scatter, axis_name="tp",
                           implementation=implementation)
  for check_vma in (True, False):
    helpers.assert_close(_run_grouped(body, x, w, mesh, check_vma), want,
                         tol=helpers.forward_tolerance("bfloat16", D), name=str(check_vma))


@pytest.mark.parametrize("implementation", ["xla", "auto"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_vjp_on_a_2d_mesh(implementation, check_vma):
  """Gradients against jax.vjp of the reference under the same shard_map, and against the
  analytic dx = dy @ w.T, dw = x.T @ dy (summed over the dp groups: w is replicated there)."""
  mesh = _mesh((G, D), ("dp", "tp"))
  x, w, _ = _grouped_inputs(seed=2)
  dy = np.random.default_rng(3).standard_normal((G * M, N)).astype(np.float32)
  x_spec, w_spec, out_spec = _specs(mesh.axis_names, "tp")
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = put(x, x_spec), put(w, w_spec), put(dy, out_spec)

  def grads(op):
    f = jax.shard_map(op, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec,
                      check_vma=check_vma)

    def run(x, w, dy):
      y, pullback = jax.vjp(f, x, w)
      return (y, *pullback(dy))

    return [np.asarray(a) for a in jax.jit(run)(*args)]

  ours = grads(functools.partial(pallas_rs.matmul_reduce_scatter, axis_name="tp",
                                 implementation=implementation))
  ref = grads(_reference)
  for name, a, b in zip(("y", "dx", "dw"), ours, ref):
    helpers.assert_close(a, b, tol=1e-6, name=f"{name} vs jax.vjp(reference)")
  dy64 = dy.astype(np.float64)
  helpers.assert_close(ours[1], dy64 @ w.T.astype(np.float64), tol=1e-5, name="dx")
  helpers.assert_close(ours[2], x.T.astype(np.float64) @ dy64, tol=1e-5, name="dw")


def test_public_fused_forward_and_grad_lower_on_a_2d_mesh():
  mesh = _mesh((2, 4), ("dp", "tp"))
  x_spec, w_spec, out_spec = _specs(mesh.axis_names, "tp")
  f = functools.partial(pallas_rs.matmul_reduce_scatter, axis_name="tp", implementation="fused")
  g = jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
  x = jax.ShapeDtypeStruct((2 * 512, 4 * 256), jnp.bfloat16, sharding=NamedSharding(mesh, x_spec))
  w = jax.ShapeDtypeStruct((4 * 256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, w_spec))
  with captured_peers(8) as tables:
    fwd = jax.export.export(jax.jit(g), platforms=["cuda"])(x, w)
  assert "mosaic_gpu" in fwd.mlir_module()
  check_peers(tables, (2, 4), ("dp", "tp"), "tp")
  loss = lambda a, b: jnp.sum(g(a, b).astype(jnp.float32))
  vg = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                         platforms=["cuda"])(x, w)
  assert "mosaic_gpu" in vg.mlir_module()
  assert [a.shape for a in vg.out_avals] == [(), (1024, 1024), (1024, 512)]


# --- the gate on a 2-D mesh ------------------------------------------------------------------


@pytest.fixture
def resolved(monkeypatch):
  """Pretends to be on Hopper; records what the gate resolved and the fallback reasons."""
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  monkeypatch.delenv(tuning.ENV_VAR, raising=False)
  out = {"resolved": [], "logged": []}
  decide = gate.decide

  def recording(op, **kw):
    res = decide(op, **kw)
    out["resolved"].append((kw["num_devices"], res))
    return res

  monkeypatch.setattr(gate, "decide", recording)
  monkeypatch.setattr(platform, "log_fallback_once", out["logged"].append)
  return out


def _trace(mesh, axis_name, m, k_shard, n, *, axis_names=None, implementation="auto"):
  """Traces the public op in a shard_map over `axis_names` (default: all mesh axes), not run or
  lowered: per device x [m, k_shard], w [k_shard, n]; the other manual axes split x's rows."""
  reduced = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  manual = set(mesh.axis_names) if axis_names is None else axis_names
  groups = tuple(a for a in mesh.axis_names if a not in reduced and a in manual)
  x_spec, w_spec = P(groups or None, axis_name), P(axis_name, None)
  out_spec = P((*groups, *reduced), None)
  body = functools.partial(pallas_rs.matmul_reduce_scatter, axis_name=axis_name,
                           implementation=implementation)
  smap = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec,
                       check_vma=False, axis_names=manual)
  d = int(np.prod([mesh.shape[a] for a in reduced]))
  rows = int(np.prod([mesh.shape[a] for a in groups])) * m
  x = jax.ShapeDtypeStruct((rows, d * k_shard), jnp.bfloat16, sharding=NamedSharding(mesh, x_spec))
  w = jax.ShapeDtypeStruct((d * k_shard, n), jnp.bfloat16, sharding=NamedSharding(mesh, w_spec))
  jax.eval_shape(smap, x, w)


def _entry(d, m, n, k_shard, implementation, kind):
  cfg = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
  return {"key": {"gpu_kind": kind, "num_devices": d, "m": m, "n": n, "k_shard": k_shard,
                  "dtype": "bfloat16"},
          "implementation": implementation, "config": tuning.config_to_json(cfg),
          "times_us": {"fused": [10.0], "xla": [12.0] if implementation == "fused" else [9.0]},
          "env": {"jax_version": "test"}, "measured_with": "tests/test_mesh2d.py"}


def test_auto_uses_the_table_by_the_size_of_the_reduced_axis(resolved):
  kind = jax.devices()[0].device_kind
  m, n, k_shard = 1024, 512, 256
  # Fused measured to win at D = 4; XLA at D = 8 (the mesh's size): only D = 4 may be used.
  table = {"schema_version": 1, "entries": [_entry(4, m, n, k_shard, "fused", kind),
                                            _entry(8, m, n, k_shard, "xla", kind)]}
  with tuning.use_table(table):
    _trace(_mesh((2, 4), ("dp", "tp")), "tp", m, k_shard, n)
    _trace(_mesh((4, 2), ("tp", "dp")), "tp", m, k_shard, n)
    _trace(_mesh((4, 2), ("dp", "tp")), "tp", m, k_shard, n)
  (d1, first), (d2, second), (d3, third) = resolved["resolved"]
  assert (d1, first.implementation, first.fallback) == (4, "fused", None)
  assert (d2, second.implementation, second.fallback) == (4, "fused", None)
  assert first.reason.startswith("tuning (table): measured ('cpu', 4, 1024,")
  assert (d3, third.implementation) == (2, "xla")
  assert third.reason.startswith("tuning (default): no measurement for ('cpu', 2, 1024,")


@pytest.mark.parametrize("case,match", [
    ("tuple_axis", r"reduces over one mesh axis; axis_name=\('dp', 'tp'\) spans 2 axes"),
    ("partial_manual", r"every mesh axis manual.*\['dp'\] of the mesh"),
])
def test_auto_falls_back_with_the_reason(resolved, case, match):
  mesh = _mesh((2, 4), ("dp", "tp"))
  if case == "tuple_axis":
    _trace(mesh, ("dp", "tp"), 1024, 256, 512)
  else:
    _trace(mesh, "tp", 1024, 256, 512, axis_names={"tp"})
  ((_, res),) = resolved["resolved"]
  assert res.implementation == "xla"
  assert resolved["logged"] and all(r == res.reason for r in resolved["logged"])
  assert any(re.search(match, r) for r in resolved["logged"]), resolved["logged"]
  with pytest.raises(NotImplementedError, match=match):  # "fused" raises it
    if case == "tuple_axis":
      _trace(mesh, ("dp", "tp"), 1024, 256, 512, implementation="fused")
    else:
      _trace(mesh, "tp", 1024, 256, 512, axis_names={"tp"}, implementation="fused")


def test_tuple_axis_with_one_nontrivial_axis_runs_on_that_axis():
  mesh = _mesh((1, 8), ("dp", "tp"))
  f = functools.partial(fused.fused_matmul_reduce_scatter, axis_name=("dp", "tp"),
                        num_devices=8)
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, ("dp", "tp")), P(("dp", "tp"))),
                            out_specs=P(("dp", "tp")), check_vma=False))
  x = jax.ShapeDtypeStruct((1024, 8 * 256), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(None, ("dp", "tp"))))
  w = jax.ShapeDtypeStruct((8 * 256, 512), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(("dp", "tp"))))
  with captured_peers(8) as tables:
    jax.export.export(g, platforms=["cuda"])(x, w)
  check_peers(tables, (1, 8), ("dp", "tp"), "tp")


def _permuted_mesh():
  devices = np.array(jax.devices())[[1, 0, 2, 3, 4, 5, 6, 7]].reshape(2, 4)
  return jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(EXPLICIT, EXPLICIT))


def test_non_row_major_device_order_falls_back(resolved):
  mesh = _permuted_mesh()
  x, w, want = _grouped_inputs(seed=4, dtype=jnp.bfloat16)
  w = w[:, :N]
  # row_parallel_matmul knows its mesh: "auto" falls back (x is replicated over dp here).
  out = pallas_rs.row_parallel_matmul(x[:M], w, mesh=mesh, axis_name="tp")
  helpers.assert_close(np.asarray(out), want[:M], tol=helpers.forward_tolerance("bfloat16", D))
  ((_, res),) = resolved["resolved"]
  assert res.implementation == "xla" and "row-major" in res.reason
  assert "[1, 0, 2, 3, 4, 5, 6, 7]" in res.reason
  with pytest.raises(NotImplementedError, match="row-major order"):
    pallas_rs.row_parallel_matmul(x[:M], w, mesh=mesh, axis_name="tp", implementation="fused")
  # Inside a bare shard_map under jit only the abstract mesh is visible; with jax.set_mesh
  # the concrete one is, and the gate falls back too.
  with jax.set_mesh(mesh):
    _trace(mesh, "tp", 1024, 256, 512)
  assert resolved["resolved"][-1][1].implementation == "xla"
  assert "row-major" in resolved["resolved"][-1][1].reason
  # A row-major mesh of the same shape passes the same check.
  with jax.set_mesh(_mesh((2, 4), ("dp", "tp"))):
    _trace(_mesh((2, 4), ("dp", "tp")), "tp", 1024, 256, 512)
  assert "row-major" not in str(resolved["resolved"][-1][1].reason)


def test_multi_process_is_refused_with_the_multicast_reason(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  multicast = ("in multi-process mode (jax 0.10.2-0.11.x) Mosaic GPU asks NCCL for an NVLink "
               "multicast address for every kernel parameter, and NVLink multicast is off")
  with pytest.raises(NotImplementedError, match=r"one process.*multicast.*process_count=2"):
    fused.check_mesh("tp")
  # "auto": the platform check comes first and gives the same reason.
  impl, _, reason = gate.decide(
      "matmul_rs", m=1024, k_shard=256, n=512, dtype=jnp.bfloat16, num_devices=4,
      implementation="auto", axis_name="tp")
  assert impl == "xla" and multicast in reason and "process_count=2" in reason


# --- experiments/mesh2d_check.py (the four-GPU run), its CPU plumbing ------------------------

STAND_INS = """
import jax
from jax import lax
import jax.numpy as jnp
def stand_in(x, w, *, axis_name, num_devices, config=None):
  out = reference.matmul_reduce_scatter(x, w, axis_name=axis_name)
  if {mix} and "dp" in jax.sharding.get_abstract_mesh().axis_names:
    out = (lax.psum(out.astype(jnp.float32), "dp") / 2).astype(out.dtype)  # groups mixed
  return out
fused.fused_matmul_reduce_scatter = stand_in
"""


@pytest.mark.slow  # An experiment script end to end: the slow layer (tests/conftest.py).
@pytest.mark.parametrize("mix", [False, True])
def test_mesh2d_check_script_checks_what_it_runs(tmp_path, mix):
  """The script's checks with the kernel replaced by the XLA path (right), or by one that mixes
  the two data-parallel groups on the 2-D mesh (wrong: every check must see it)."""
  import json  # pylint: disable=g-import-not-at-top
  out = tmp_path / "mesh2d.json"
  proc = helpers.run_script_with_stand_ins(
      "mesh2d_check.py", ["--names=llama70b_o_proj_m512,mixtral8x22b_w2_m2048", "--scale=64",
                          "--iterations=2", f"--out={out}"],
      stand_ins=STAND_INS.format(mix=mix), after_load="mod.require_gpus = lambda: None")
  assert out.exists(), proc.stderr[-3000:]
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert [r["name"] for r in rows] == ["llama70b_o_proj_m512", "mixtral8x22b_w2_m2048"]
  assert all("error" not in r for r in rows), [r.get("error") for r in rows]
  assert result["mesh"] == {"dp": 2, "tp": 2} and result["environment"]["jax_version"]
  for r in rows:
    assert (r["m"], r["k_shard"]) in ((8, 64), (32, 128))
    assert r["auto_expected"] == "xla" and r["ok_auto"]  # CPU: "auto" is XLA, as expected
    assert r["ok_error"] is (not mix) and r["bit_identical_1d"] is (not mix), r
    assert all(r[f"t_{key}_us"] > 0 for key in ("fused_2d", "fused_1d", "unfused_2d"))
    assert r["timer"] == "host_wall_clock"
  assert (proc.returncode == 0) is (not mix), proc.stderr[-3000:]
  assert "2D/1D" in proc.stdout.splitlines()[-3]  # the table comes last


def test_mesh2d_check_script_lower_only(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  out = tmp_path / "lower.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = str(helpers.REPO)
  proc = subprocess.run(
      [sys.executable, "experiments/mesh2d_check.py", "--lower_only",
       "--names=mixtral8x22b_o_proj_m2048", f"--out={out}"],
      capture_output=True, text=True, env=env, cwd=helpers.REPO, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert row["lowered_fused_2d"] and row["lowered_fused_1d"] and row["k_shard"] == 6144 // 2
