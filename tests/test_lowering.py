"""The fused kernel lowers for CUDA from this CPU machine (jax.export, platforms=["cuda"]).

Lowering runs Mosaic GPU's compiler up to its own checks (shared-memory budget, tiling, TMA
boxes, layouts), so a config that cannot compile fails here, without a GPU.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import pytest

import helpers
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import defaults
from pallas_rs.kernel import fused
from pallas_rs.tuning import candidates
from pallas_rs.bench import shapes

SEEDS = shapes.select(tags="seed")


def _seed_params_at_d8():
  """The 16 seed shapes at D = 8; in the fast layer the first of each distinct default kernel
  config (pairs at m = 512 among them), so that a config family that fails to lower fails the
  default run; the others are slow (4-7 s each on 2 CPU cores; tests/conftest.py)."""
  seen, params = set(), []
  for case in SEEDS:
    cfg = defaults.default_config(m=case.m, n=case.n, k_shard=case.k // 8, num_devices=8)
    params.append(pytest.param(case, id=case.name,
                               marks=pytest.mark.slow if cfg in seen else ()))
    seen.add(cfg)
  return params


def _export_shard_map(m, n, k, d, config=None, unverified=False):
  mesh = helpers.make_mesh(d)
  f = functools.partial(fused.fused_matmul_reduce_scatter, axis_name=helpers.AXIS,
                        num_devices=d, config=config, unverified=unverified)
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, helpers.AXIS), P(helpers.AXIS, None)),
                            out_specs=P(helpers.AXIS, None), check_vma=False))
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, helpers.AXIS)))
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, P(helpers.AXIS, None)))
  exported = jax.export.export(g, platforms=["cuda"])(x, w)
  text = exported.mlir_module()
  assert "mosaic_gpu" in text
  # XLA's barrier orders the peers' semaphore fills before our first signal (docs/design.md 7):
  # never skipped (the custom call carries the switch from jax 0.11.2 on).
  assert not re.search(r"skip_device_barrier\s*=\s*true", text)
  return exported


@pytest.mark.parametrize("case", _seed_params_at_d8())
def test_seed_shapes_lower_at_d8(case):
  exported = _export_shard_map(case.m, case.n, case.k, 8)
  assert exported.out_avals[0].shape == (case.m, case.n)


@pytest.mark.parametrize("d", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["llama70b_o_proj_m512", "mixtral8x22b_w2_m2048"])
def test_lowers_at_d2_d4(name, d):
  case = shapes.by_name(name)
  _export_shard_map(case.m, case.n, case.k, d)


@pytest.mark.parametrize("d", [2, 8])
def test_loopback_and_local_lower(d):
  xs = jax.ShapeDtypeStruct((d, 128 * d, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((d, 256, 512), jnp.bfloat16)
  jax.export.export(jax.jit(fused.loopback_matmul_reduce_scatter), platforms=["cuda"])(xs, ws)
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  jax.export.export(jax.jit(fused.local_matmul), platforms=["cuda"])(x, w)


# One rank alone (timing on one GPU): the default configs of D = 2 and of D = 8 at 64-row chunks
# (pairs), and pushing comm CTAs (idle under the "comm" ablation), each with and without "reduce".
@pytest.mark.parametrize("d,m,n,k_shard,config", [
    (2, 512, 8192, 4096, None), (8, 512, 8192, 1024, None),
    (2, 2048, 6144, 1024, config_lib.Config(comm_ctas=4, comm_mode="push"))])
def test_rank_alone_lowers(d, m, n, k_shard, config):
  x = jax.ShapeDtypeStruct((m, k_shard), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((k_shard, n), jnp.bfloat16)
  for ablate in (("comm",), ("comm", "reduce"), ("comm", "owner_add")):
    f = functools.partial(fused.rank_alone, num_devices=d, rank=d - 1, config=config,
                          ablate=ablate)
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(x, w)
    assert exported.out_avals[0].shape == (m // d, n)
    assert "mosaic_gpu" in exported.mlir_module()


# tma_add (D = 2, the ring's numerics: the owner TMA-adds its own partial onto the peer's, which
# lands in its output): under shard_map, in loopback with pairs (M = 128), and one rank alone.
@pytest.mark.parametrize("m,n,k_shard,tiles", [
    (512, 8192, 4096, None), (128, 1024, 512, (64, 256, config_lib.MatmulDimension.M))])
def test_tma_add_lowers(m, n, k_shard, tiles):
  cfg = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=2)
  if tiles:
    cfg = dataclasses.replace(cfg, tile_m=tiles[0], tile_n=tiles[1], wg_dimension=tiles[2])
  cfg = config_lib.fit_smem(dataclasses.replace(cfg, tma_add=True), 2)
  assert cfg.numerics == "unfused_order" and (cfg.chunk_group(m, 2) == 2) == (m == 128)
  # No receive stages in SMEM, no receive buffer.
  assert cfg.smem_bytes(2) < dataclasses.replace(cfg, tma_add=False).smem_bytes(2)
  xs, ws = (jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((2, m, k_shard), (2, k_shard, n)))
  text = jax.export.export(jax.jit(functools.partial(
      fused.loopback_matmul_reduce_scatter, config=cfg)), platforms=["cuda"])(
          xs, ws).mlir_module()
  assert "cp.reduce" in text  # the TMA add made it into the kernel
  if tiles:
    return
  for mode, ctas in (("pull", 4), ("push", 2)):  # comm CTAs land the partial in the output too
    comm = config_lib.fit_smem(dataclasses.replace(cfg, comm_mode=mode, comm_ctas=ctas), 2)
    jax.export.export(jax.jit(functools.partial(
        fused.loopback_matmul_reduce_scatter, config=comm)), platforms=["cuda"])(xs, ws)
  _export_shard_map(m, n, k_shard * 2, 2, config=cfg)
  for ablate in (("comm",), ("comm", "reduce")):
    f = functools.partial(fused.rank_alone, num_devices=2, config=cfg, ablate=ablate)
    jax.export.export(jax.jit(f), platforms=["cuda"])(
        jax.ShapeDtypeStruct((m, k_shard), jnp.bfloat16),
        jax.ShapeDtypeStruct((k_shard, n), jnp.bfloat16))


def test_tma_add_refusals():
  # bf16 partials into an fp32 sum: widened by the comm CTAs it ran slower (BUILD_NOTES
  # 2026-12-01, tenth session; git tag sum-slot-upcast-v1).
  with pytest.raises(ValueError, match="does not add bf16 partials into an fp32 sum"):
    config_lib.Config(tma_add=True, comm_ctas=2, comm_mode="pull")
  shape = dict(m=1024, n=1024, k_shard=512)
  ring = dict(owner_sum="bf16_ring", tma_add=True)
  f32 = dict(partial_dtype="float32", epi_tile_n=32, tma_add=True)
  pull = dict(comm_ctas=2, comm_mode="pull")
  # At D > 2 only pulling comm CTAs add in a fixed order (docs/design.md section 3.5).
  for kw in ({}, dict(comm_ctas=2), dict(comm_ctas=2, comm_mode="push")):
    for numerics in (ring, f32):
      with pytest.raises(NotImplementedError, match="with pulling comm CTAs at D > 2"):
        config_lib.Config(**numerics, **kw).check_shape(**shape, num_devices=4)
  for numerics in (ring, f32):
    config_lib.Config(**numerics, **pull).check_shape(**shape, num_devices=4)
  config_lib.Config(**ring, comm_ctas=2).check_shape(**shape, num_devices=2)  # comm CTAs land it
  # The fp32 sum slot only at D > 2 (at D = 2 one partial: the receive slot itself).
  for kw in ({}, pull):
    with pytest.raises(NotImplementedError, match="'fp32_partials' at num_devices=2 runs only"):
      config_lib.Config(**f32, **kw).check_shape(**shape, num_devices=2)
  # Numerics transforms keep it only where it runs in the new mode.
  cfg = config_lib.Config(**ring)
  assert config_lib.with_numerics(cfg, "unfused_order", 2).tma_add
  assert not config_lib.with_numerics(cfg, "fp32_partials", 2).tma_add
  assert not config_lib.with_partial_dtype(cfg, "bfloat16", 2).tma_add
  pulled = config_lib.Config(**ring, **pull)
  assert config_lib.with_numerics(pulled, "fp32_partials", 4).sum_slot
  assert not config_lib.with_numerics(pulled, "fp32_partials", 2).tma_add
  assert not config_lib.with_numerics(pulled, "bf16_partials", 4).tma_add


def test_m_split_without_tma_add_is_refused_over_nvlink():
  # It stalled in 3 of 3 tries on two H200s (fused.nvlink_unverified): refused on NVLink at
  # any D > 1 unless an experiment asks, run by loopback and rank_alone (no NVLink), and the
  # same tiles with the TMA add or the warpgroups along N pass.
  from pallas_rs.tuning import gate  # pylint: disable=g-import-not-at-top
  m_split = config_lib.Config(tile_m=64, tile_n=256, wg_dimension=config_lib.MatmulDimension.M)
  problem = dict(m=2048, k_shard=1024, n=2048, dtype=jnp.bfloat16)
  for d, cfg in [(2, config_lib.with_numerics(m_split, "fp32_partials", 2)),
                 (2, config_lib.with_numerics(m_split, "unfused_order", 2)),
                 (4, config_lib.fit_smem(config_lib.with_numerics(m_split, "fp32_partials", 4),
                                         4))]:
    assert not cfg.tma_add
    with pytest.raises(NotImplementedError, match="along M without the TMA add"):
      fused.check_supported(**problem, num_devices=d, config=cfg)
    assert fused.check_supported(**problem, num_devices=d, config=cfg, unverified=True) == cfg
    assert fused.check_supported(**problem, num_devices=d, config=cfg, loopback=True) == cfg
    # "auto" with it falls back to XLA, saying why; "fused" raises.
    dec = gate.decide("matmul_rs", **problem, num_devices=d, config=cfg, gpu_kind="NVIDIA H200")
    assert dec.implementation == "xla" and "along M without the TMA add" in dec.fallback
    with pytest.raises(NotImplementedError, match="along M without"):
      gate.decide("matmul_rs", **problem, num_devices=d, config=cfg, implementation="fused",
                  gpu_kind="NVIDIA H200")
  added = dataclasses.replace(config_lib.with_numerics(m_split, "unfused_order", 2), tma_add=True)
  fused.check_supported(**problem, num_devices=2, config=added)
  n_split = config_lib.Config(tile_m=128, tile_n=128)
  fused.check_supported(**problem, num_devices=4, config=config_lib.fit_smem(
      config_lib.with_numerics(n_split, "fp32_partials", 4), 4))
  # Nor has a 256-column wgmma tile along N run without the add (the stall's other suspect).
  wide = config_lib.fit_smem(config_lib.Config(tile_m=64, tile_n=256), 2)
  with pytest.raises(NotImplementedError, match="64 x 256 side by side along N"):
    fused.check_supported(**problem, num_devices=2, config=wide)
  assert config_lib.with_wg_along_n(m_split) == dataclasses.replace(
      m_split, tile_m=128, tile_n=128, wg_dimension=config_lib.MatmulDimension.N)
  fused.check_supported(**dict(problem, m=1024), num_devices=1, config=m_split)  # no peers
  x, w = jnp.zeros((2048, 1024), jnp.bfloat16), jnp.zeros((1024, 2048), jnp.bfloat16)
  jax.eval_shape(functools.partial(fused.rank_alone, num_devices=4, config=config_lib.fit_smem(
      config_lib.with_numerics(m_split, "fp32_partials", 4), 4)), x, w)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_devices=2, ablate=()), "must contain 'comm'"),
    (dict(num_devices=2, ablate=("reduce",)), "must contain 'comm'"),
    (dict(num_devices=2, rank=2), "0 <= rank < num_devices"),
    (dict(num_devices=1), "2 <= num_devices"),
])
def test_rank_alone_refuses(kwargs, match):
  x = jnp.zeros((512, 256), jnp.bfloat16)
  w = jnp.zeros((256, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    fused.rank_alone(x, w, **kwargs)


def test_smem_estimate_agrees_with_mosaic(monkeypatch):
  # Over the limit per our estimate; with our check bypassed, Mosaic rejects it too.
  cfg = config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=5)
  assert not cfg.fits_smem(8)
  xs = jax.ShapeDtypeStruct((8, 1024, 512), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((8, 512, 1024), jnp.bfloat16)
  f = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
  with pytest.raises(NotImplementedError, match="shared memory"):
    jax.export.export(f, platforms=["cuda"])(xs, ws)
  monkeypatch.setattr(config_lib.Config, "fits_smem", lambda self, d, limit=0: True)
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    jax.export.export(f, platforms=["cuda"])(xs, ws)
  # One stage fewer fits by both counts.
  monkeypatch.undo()
  cfg4 = config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=3)
  assert cfg4.fits_smem(8)
  jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg4)),
                    platforms=["cuda"])(xs, ws)


@pytest.mark.parametrize("m,n,k,match", [
    (8 * 96, 1024, 8 * 64, "not a multiple of the CTA tile.s 128 rows .tile_m=128"),
    (8 * 128, 1024, 8 * 96, "k_shard=96 is not a multiple of tile_k=64"),
    (8 * 128, 1000, 8 * 64, "n=1000 is not a multiple"),
])
def test_unsupported_shapes_are_named(m, n, k, match):
  cfg = config_lib.Config(tile_m=128, tile_n=64)
  with pytest.raises(NotImplementedError, match=match):
    fused.check_supported(m=m, k_shard=k // 8, n=n, dtype=jnp.bfloat16, num_devices=8, config=cfg)


def test_default_config_rejects_tiny_chunks():
  with pytest.raises(NotImplementedError, match=r"8 = 32 rows is below the smallest tile \(64\)"):
    fused.check_supported(m=8 * 32, k_shard=64, n=256, dtype=jnp.bfloat16, num_devices=8)
  # Nor does an explicit 64-row tile along N take 32-row chunks as pairs: its halves would be
  # 32 rows, below the 64-row wgmma and epilogue blocks.
  cfg = config_lib.Config(tile_m=64, tile_n=128)
  assert cfg.chunk_group(8 * 32, 8) == 1 and cfg.chunk_group(8 * 64, 8) == 1
  assert config_lib.Config(tile_m=128, tile_n=128).chunk_group(8 * 64, 8) == 2
  with pytest.raises(NotImplementedError, match="32 is not a multiple of the CTA tile's 64 rows"):
    fused.check_supported(m=8 * 32, k_shard=64, n=256, dtype=jnp.bfloat16, num_devices=8,
                          config=cfg)


def test_non_bf16_is_not_implemented():
  with pytest.raises(NotImplementedError, match="bfloat16 only"):
    fused.check_supported(m=1024, k_shard=64, n=256, dtype=jnp.float32, num_devices=8)


def test_config_validation_messages():
  with pytest.raises(ValueError, match="tile_m=96 must be 64 or 128"):
    config_lib.Config(tile_m=96)
  with pytest.raises(ValueError, match="tile_n=128 must be divisible by epi_tile_n=48"):
    config_lib.Config(tile_n=128, epi_tile_n=48)
  with pytest.raises(ValueError, match="max_concurrent_steps=1 must be >= 2"):
    config_lib.Config(max_concurrent_steps=1)


@pytest.mark.parametrize("case", SEEDS[::5], ids=lambda c: c.name)
def test_every_search_space_config_fits(case):
  for d in (1, 8):
    for cfg in candidates.search_space(m=case.m, n=case.n, k_shard=case.k // 8, num_devices=d):
      assert cfg.fits_smem(d), cfg


@pytest.mark.slow  # ~40 s on 2 CPU cores: the slow layer (tests/conftest.py).
def test_every_shipped_table_config_lowers():
  """Every config the tuner can hand to the kernel (the packaged table's) compiles for CUDA."""
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  # The row-parallel kernel's entries ("ag_matmul" entries configure jax's all-gather matmul).
  entries = [e for e in tuning.packaged_table()["entries"] if tuning.entry_op(e) == "matmul_rs"]
  assert entries, "the packaged tuning table has no matmul_rs entry"
  for entry in entries:
    key, cfg = entry["key"], tuning.config_from_json(entry["config"])
    m, n, k_shard, d = key["m"], key["n"], key["k_shard"], key["num_devices"]
    if (d > 1 and cfg.comm_ctas and cfg.comm_mode == "pull"
        and not fused.remote_tma_loads_supported()):
      # Lowers from jax fused.REMOTE_TMA_LOAD_JAX on; an older jax refuses it, saying so.
      with pytest.raises(NotImplementedError, match="comm_mode='pull' TMA-loads from peers"):
        _export_shard_map(m, n, k_shard * d, d, config=cfg)
      continue
    if d == 1:
      x = jax.ShapeDtypeStruct((m, k_shard), jnp.bfloat16)
      w = jax.ShapeDtypeStruct((k_shard, n), jnp.bfloat16)
      jax.export.export(jax.jit(functools.partial(fused.local_matmul, config=cfg)),
                        platforms=["cuda"])(x, w)
    else:
      _export_shard_map(m, n, k_shard * d, d, config=cfg)


def test_axis_tuple_spanning_two_mesh_axes_is_not_implemented(monkeypatch):
  """The kernel reduces over one mesh axis (other axes: tests/test_mesh2d.py); a tuple of two
  non-trivial axes is refused by "fused" and falls back under "auto"."""
  from pallas_rs import api  # pylint: disable=g-import-not-at-top
  from pallas_rs import platform  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  axes = ("dp", "tp")
  x = jnp.ones((256, 8 * 64), jnp.bfloat16)
  w = jnp.ones((8 * 64, 256), jnp.bfloat16)

  def run(impl):
    f = functools.partial(pallas_rs_api_call, impl=impl)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, axes), P(axes, None)),
                                 out_specs=P(axes, None), check_vma=False))(x, w)

  def pallas_rs_api_call(x, w, impl):
    return api.matmul_reduce_scatter(x, w, axis_name=axes, implementation=impl)

  with pytest.raises(NotImplementedError, match="reduces over one mesh axis"):
    run("fused")
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  out = run("auto")  # Falls back to XLA, with the reason logged.
  # Per device [256, 64] @ [64, 256] of ones, summed over the 8 devices: 512 everywhere.
  assert out.shape == (256, 256)
  assert bool(jnp.all(out.astype(jnp.float32) == 8 * 64))


def test_multi_process_is_refused(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(NotImplementedError, match="one process"):
    fused.check_mesh("x")
  with pytest.raises(NotImplementedError, match="process_count=2"):
    _export_shard_map(1024, 1024, 1024, 8)


def test_public_api_fused_forward_and_grad_lower_with_check_vma():
  """The public op with implementation="fused" under shard_map's default check_vma=True,
  forward and gradient (custom VJP), lowers for CUDA."""
  import pallas_rs  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
  f = functools.partial(pallas_rs.matmul_reduce_scatter, axis_name="tp", implementation="fused")
  g = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                    out_specs=P("tp", None))
  x = jax.ShapeDtypeStruct((1024, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
  w = jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp", None)))
  fwd = jax.export.export(jax.jit(g), platforms=["cuda"])(x, w)
  assert "mosaic_gpu" in fwd.mlir_module()
  loss = lambda a, b: jnp.sum(g(a, b).astype(jnp.float32))
  vg = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                         platforms=["cuda"])(x, w)
  assert "mosaic_gpu" in vg.mlir_module()  # the loss value needs the forward kernel
  assert [a.shape for a in vg.out_avals] == [(), (1024, 8192), (8192, 1024)]


# Both stages left out in the fast layer; each alone in the slow layer (tests/conftest.py).
@pytest.mark.parametrize("ablate", [pytest.param(("comm",), marks=pytest.mark.slow),
                                    pytest.param(("reduce",), marks=pytest.mark.slow),
                                    ("comm", "reduce")])
def test_ablation_variants_lower(ablate):
  mesh = helpers.make_mesh(8)
  f = functools.partial(fused.fused_matmul_reduce_scatter, axis_name=helpers.AXIS,
                        num_devices=8, ablate=ablate)
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, helpers.AXIS), P(helpers.AXIS, None)),
                            out_specs=P(helpers.AXIS, None), check_vma=False))
  x = jax.ShapeDtypeStruct((512, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, helpers.AXIS)))
  w = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P(helpers.AXIS, None)))
  text = jax.export.export(g, platforms=["cuda"])(x, w).mlir_module()
  assert "mosaic_gpu" in text
  xs = jax.ShapeDtypeStruct((8, 1024, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)
  jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, ablate=ablate)),
                    platforms=["cuda"])(xs, ws)


def test_unknown_ablation_is_rejected():
  xs = jax.ShapeDtypeStruct((8, 1024, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="must be a subset"):
    fused.loopback_matmul_reduce_scatter(xs, ws, ablate=("mainloop",))


def test_grid_larger_than_the_gpu_is_refused(monkeypatch):
  monkeypatch.setattr(fused, "gpu_num_sms", lambda: 114)  # e.g. an H100 PCIe
  assert fused.check_supported(m=1024, k_shard=64, n=256, dtype=jnp.bfloat16,
                               num_devices=8).num_sms == 114
  with pytest.raises(NotImplementedError, match="num_sms=132 exceeds the 114 SMs"):
    fused.check_supported(m=1024, k_shard=64, n=256, dtype=jnp.bfloat16, num_devices=8,
                          config=config_lib.Config(num_sms=132))


@pytest.mark.parametrize("eager", [1, pytest.param(7, marks=pytest.mark.slow)])
def test_eager_signal_configs_lower(eager):
  cfg = config_lib.Config(tile_m=64, tile_n=128, eager_signal_steps=eager)
  _export_shard_map(512, 8192, 8192, 8, config=cfg)
  xs = jax.ShapeDtypeStruct((8, 1024, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)
  jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg)),
                    platforms=["cuda"])(xs, ws)


# Fast layer, at D = 2: the direct push, the pushing comm CTAs, both partial dtypes and the
# whole-tile epilogue slots. Slow layer (tests/conftest.py): the pushing comm CTAs with float32
# partials (each half lowered by another case) and D = 8 (10-30 s each on 2 CPU cores).
@pytest.mark.parametrize("d", [2, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("comm,out_slots,partial_dtype", [
    (0, 0, "float32"), (4, 0, "bfloat16"), pytest.param(2, 0, "float32", marks=pytest.mark.slow),
    (0, 4, "bfloat16")])
def test_comm_ctas_and_partial_dtypes_lower(d, comm, out_slots, partial_dtype):
  """The communication paths of docs/design.md 3.2, whole-tile epilogue slots and both partial
  dtypes: under shard_map, in loopback, and with the communication ablated."""
  base = config_lib.Config(comm_ctas=comm, out_slots=out_slots)
  cfg = config_lib.with_partial_dtype(base, partial_dtype, d)
  assert cfg.num_out_slots == (out_slots or 2)
  assert cfg.fits_smem(d) and cfg.partial_dtype == partial_dtype
  _export_shard_map(1024, 1024, 1024, d, config=cfg)
  xs = jax.ShapeDtypeStruct((d, 256 * d, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((d, 256, 512), jnp.bfloat16)
  for ablate in ((), ("comm",)) + ((("gemm",),) if comm else ()):
    exported = jax.export.export(jax.jit(functools.partial(
        fused.loopback_matmul_reduce_scatter, config=cfg, ablate=ablate)), platforms=["cuda"])(
            xs, ws)
    assert exported.out_avals[0].shape == (d, 256, 512)


def test_fp32_partials_without_room_are_refused():
  cfg = config_lib.Config(partial_dtype="float32", epi_tile_n=64, max_concurrent_steps=4)
  with pytest.raises(NotImplementedError, match="shared memory"):
    cfg.check_shape(m=1024, n=1024, k_shard=512, num_devices=2)


def test_comm_ctas_are_limited_by_the_rank_s_ctas():
  # On devices each rank has all num_sms CTAs (16 pulling CTAs at D = 8 are legal); in
  # loopback the D ranks share them (132 // 8 = 16: none left to compute).
  cfg = config_lib.Config(comm_ctas=16, comm_mode="pull")
  cfg.check_shape(m=8192, n=8192, k_shard=1024, num_devices=8)
  with pytest.raises(NotImplementedError, match="loopback rank"):
    cfg.check_shape(m=8192, n=8192, k_shard=1024, num_devices=8, loopback=True)
  with pytest.raises(NotImplementedError, match="leaves no compute CTA among the 132"):
    config_lib.Config(comm_ctas=132).check_shape(m=8192, n=8192, k_shard=1024, num_devices=2)


def test_sixteen_pulling_comm_ctas_lower_in_loopback():
  cfg = config_lib.with_numerics(config_lib.Config(comm_ctas=16, comm_mode="pull"),
                                 "unfused_order", 2)
  xs = jax.ShapeDtypeStruct((2, 512 * 2, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((2, 256, 2048), jnp.bfloat16)
  exported = jax.export.export(jax.jit(functools.partial(
      fused.loopback_matmul_reduce_scatter, config=cfg)), platforms=["cuda"])(xs, ws)
  assert exported.out_avals[0].shape == (2, 512, 2048)


# Fast layer: float32 partials, every ablation. Slow layer (tests/conftest.py): "unfused_order"
# (the fast layer lowers its pull in test_sixteen_pulling_comm_ctas_lower_in_loopback), D = 8.
@pytest.mark.parametrize("d", [2, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("numerics", [pytest.param("unfused_order", marks=pytest.mark.slow),
                                      "fp32_partials"])
def test_pull_comm_ctas_lower_in_loopback(d, numerics):
  """Kernel v3 with pulling comm CTAs (docs/design.md section 3.2): loopback reads a peer's
  staging buffer with a plain TMA load, which lowers on every supported jax."""
  cfg = config_lib.with_numerics(config_lib.Config(comm_ctas=4, comm_mode="pull"), numerics, d)
  xs = jax.ShapeDtypeStruct((d, 256 * d, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((d, 256, 512), jnp.bfloat16)
  for ablate in ((), ("comm",), ("gemm",), ("gemm", "stage_wait", "recv_store", "owner_wait"),
                 ("gemm", "stage_wait", "recv_store", "owner_wait", "comm_signal")):
    jax.export.export(jax.jit(functools.partial(
        fused.loopback_matmul_reduce_scatter, config=cfg, ablate=ablate)), platforms=["cuda"])(
            xs, ws)


@pytest.mark.parametrize("d", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_ring_chain_of_pulling_comm_ctas_lowers(d):
  """tma_add at D > 2: pulling comm CTAs store the first partial into the output and TMA-add
  the others in ring order; no receive buffer (loopback and NVLink where remote TMA loads
  lower). The lowered kernel differs from the receive-slot one by its TMA adds."""
  base = config_lib.with_numerics(config_lib.Config(comm_ctas=2, comm_mode="pull"),
                                  "unfused_order", d)
  xs = jax.ShapeDtypeStruct((d, 128 * d, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((d, 256, 512), jnp.bfloat16)
  texts = {}
  for add in (False, True):
    cfg = dataclasses.replace(base, tma_add=add)
    # The kernel's extra outputs: staging, and receive slots only without the add.
    assert len(fused._exchange_buffers((d,), d, 128, 512, cfg)) == (1 if add else 2)
    texts[add] = jax.export.export(jax.jit(functools.partial(
        fused.loopback_matmul_reduce_scatter, config=cfg)), platforms=["cuda"])(
            xs, ws).mlir_module()
  assert "cp.reduce" in texts[True] and "cp.reduce" not in texts[False]
  if fused.remote_tma_loads_supported():
    _export_shard_map(128 * d, 512, 256 * d, d, config=dataclasses.replace(base, tma_add=True))


# D = 4 and 8 in the slow layer (~20 s each on 2 CPU cores): D = 3 takes the same path.
@pytest.mark.parametrize("d", [3, pytest.param(4, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow)])
def test_fp32_sum_slot_of_pulling_comm_ctas_lowers(d):
  """tma_add with fp32 partials at D > 2 (Config.sum_slot): pulling comm CTAs store the first
  partial into receive slot 0 and TMA-add the others onto it in ring order; one receive slot
  instead of D - 1, and the owner's receive stages stay (it loads the sum). Every ablation
  that applies lowers, and NVLink where remote TMA loads lower."""
  base = config_lib.with_numerics(config_lib.Config(comm_ctas=2, comm_mode="pull"),
                                  "fp32_partials", d)
  cfg = dataclasses.replace(base, tma_add=True)
  assert cfg.sum_slot and not cfg.sum_in_output and cfg.smem_bytes(d) == base.smem_bytes(d)
  recv, stage = fused._exchange_buffers((d,), d, 128, 512, cfg)
  assert recv.shape == (d, 1, 128, 512) and stage.shape == (d, d - 1, 128, 512)
  assert recv.dtype == stage.dtype == jnp.float32
  xs = jax.ShapeDtypeStruct((d, 128 * d, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((d, 256, 512), jnp.bfloat16)
  texts = {}
  for c, ablate in ((base, ()), (cfg, ()), (cfg, ("reduce",)), (cfg, ("owner_add",)),
                    (cfg, ("gemm",)), (cfg, ("comm",))):
    text = jax.export.export(jax.jit(functools.partial(
        fused.loopback_matmul_reduce_scatter, config=c, ablate=ablate)), platforms=["cuda"])(
            xs, ws).mlir_module()
    texts.setdefault(c.tma_add, text)
  assert "cp.reduce" in texts[True] and "cp.reduce" not in texts[False]
  if fused.remote_tma_loads_supported():
    _export_shard_map(128 * d, 512, 256 * d, d, config=cfg)


# D = 4 and 8 in the slow layer (~17 s at D = 4 on 2 CPU cores).
@pytest.mark.parametrize("d", [2, pytest.param(4, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow)])
def test_owner_pull_lowers(d):
  """comm_mode "owner" (docs/design.md section 3.2): remote tiles staged, the owner's epilogue
  loads each source's staged partial; a staging buffer and no receive slots; loopback with
  every ablation that applies, one rank alone, and NVLink where remote TMA loads lower (else
  refused, naming the version)."""
  cfg = config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(comm_mode="owner"),
                                                     defaults.default_numerics(d), d), d)
  assert len(fused._exchange_buffers((d,), d, 128, 512, cfg)) == 1  # staging only
  xs = jax.ShapeDtypeStruct((d, 128 * d, 256), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((d, 256, 512), jnp.bfloat16)
  for ablate in ((), ("comm",), ("reduce",), ("gemm",), ("owner_wait",)):
    jax.export.export(jax.jit(functools.partial(
        fused.loopback_matmul_reduce_scatter, config=cfg, ablate=ablate)), platforms=["cuda"])(
            xs, ws)
  jax.export.export(jax.jit(functools.partial(
      fused.rank_alone, num_devices=d, config=cfg, ablate=("comm",))), platforms=["cuda"])(
          jax.ShapeDtypeStruct((128 * d, 256), jnp.bfloat16),
          jax.ShapeDtypeStruct((256, 512), jnp.bfloat16))
  if fused.remote_tma_loads_supported():
    _export_shard_map(128 * d, 512, 256 * d, d, config=cfg)
  else:
    with pytest.raises(NotImplementedError, match="comm_mode='owner'"):
      _export_shard_map(128 * d, 512, 256 * d, d, config=cfg)


def test_owner_pull_refusals():
  with pytest.raises(ValueError, match="comm_mode='owner'"):
    config_lib.Config(comm_mode="owner", comm_ctas=2)
  with pytest.raises(ValueError, match="comm_mode='owner'"):
    config_lib.Config(comm_mode="owner", owner_sum="bf16_ring", tma_add=True)
  pairs = config_lib.Config(tile_m=64, tile_n=256, wg_dimension=config_lib.MatmulDimension.M,
                            comm_mode="owner")
  with pytest.raises(NotImplementedError, match="comm_mode='owner'"):
    pairs.check_shape(m=512, n=8192, k_shard=1024, num_devices=8)  # 64-row chunks: pairs
  assert not config_lib.tma_add_runs(2, "bf16_ring", 0, "owner")


def test_pull_over_nvlink_needs_remote_tma_loads():
  """On NVLink the pull is a TMA load from a peer: it lowers where Mosaic GPU supports that
  (jax >= fused.REMOTE_TMA_LOAD_JAX) and is refused, naming the version, elsewhere."""
  cfg = config_lib.Config(comm_ctas=2, comm_mode="pull")
  if fused.remote_tma_loads_supported():
    _export_shard_map(1024, 1024, 1024, 2, config=cfg)
  else:
    with pytest.raises(NotImplementedError, match="comm_mode='pull'"):
      _export_shard_map(1024, 1024, 1024, 2, config=cfg)


@pytest.mark.parametrize("d,comm", [
    pytest.param(1, {}, marks=pytest.mark.slow), pytest.param(2, {}, marks=pytest.mark.slow),
    (2, dict(comm_ctas=2, comm_mode="pull")),
    pytest.param(8, dict(comm_ctas=4, comm_mode="push"), marks=pytest.mark.slow)])
def test_warpgroups_along_m_lower(d, comm):
  # 128 x 192 CTA tiles (config.wg_dimension=M): the x block is split between the warpgroups,
  # w is not; the comm CTAs move each warpgroup's 64 x 192 part.
  cfg = config_lib.Config(tile_m=64, tile_n=192, wg_dimension=config_lib.MatmulDimension.M,
                          **comm)
  assert (cfg.cta_tile_m, cfg.cta_tile_n) == (128, 192)
  if d == 1:
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((512, 1024), (1024, 6144)))
    jax.export.export(jax.jit(functools.partial(fused.local_matmul, config=cfg)),
                      platforms=["cuda"])(x, w)
    return
  cfg = config_lib.fit_smem(config_lib.with_numerics(cfg, defaults.default_numerics(d), d), d)
  xs, ws = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((d, 128 * d, 512), (d, 512, 768)))
  jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg)),
                    platforms=["cuda"])(xs, ws)


# D = 4 in loopback (fast); D = 8 also under shard_map (the N split runs over NVLink), ~16 s on
# 2 CPU cores: the slow layer.
@pytest.mark.parametrize("d", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_96_column_warpgroup_tiles_lower(d):
  # 128 x 192 CTA tiles split along N: wgmma takes both operands with one swizzle, and w's
  # block splits between the warpgroups at column 96, so x and w both take the 64 B swizzle
  # (Mosaic GPU: "WGMMA rhs swizzle must match lhs swizzle"). Mixtral's N = 6144 at M = 512.
  cfg = config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(
      tile_m=128, tile_n=96, epi_tile_n=32, wg_dimension=config_lib.MatmulDimension.N),
      defaults.default_numerics(d), d), d)
  assert (cfg.cta_tile_m, cfg.cta_tile_n, cfg.operand_swizzle_cols) == (128, 192, 32)
  assert cfg.epi_tile_n == 32  # config.epi_tile_n_for: 64 would not divide 96
  xs, ws = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((d, 512, 1536), (d, 1536, 6144)))
  jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg)),
                    platforms=["cuda"])(xs, ws)
  if d == 8:
    _export_shard_map(512, 6144, 8 * 1536, 8, config=cfg)


def test_warpgroup_tiles_need_a_64_byte_swizzle_tile():
  cfg = config_lib.Config(tile_m=128, tile_n=80, epi_tile_n=16,
                          wg_dimension=config_lib.MatmulDimension.N)
  with pytest.raises(NotImplementedError, match="tile_n=80 must be a multiple of 32"):
    cfg.check_shape(m=1024, n=2560, k_shard=1024, num_devices=2)
  assert config_lib.Config().operand_swizzle_cols == 64  # the 128 B swizzle as before


# D = 4 in the slow layer (tests/conftest.py): the loopback path of D = 2 and 8 (fast).
@pytest.mark.parametrize("d", [2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_pairs_lower(d):
  # 64-row chunks under a 128-row CTA tile (schedule.chunk_group 2), in loopback at D = 2/4/8,
  # and at D = 8 under shard_map, where NVLink refuses the M split unless asked (no TMA add
  # beyond D = 2: fused.nvlink_unverified), so the D = 8 default's pairs split along N.
  cfg = config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(
      tile_m=64, tile_n=256, wg_dimension=config_lib.MatmulDimension.M),
      defaults.default_numerics(d), d), d)
  assert cfg.chunk_group(64 * d, d) == 2
  xs, ws = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((d, 64 * d, 512), (d, 512, 1024)))
  jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg)),
                    platforms=["cuda"])(xs, ws)
  if d == 8:
    default = defaults.default_config(m=512, n=8192, k_shard=1024, num_devices=8)
    assert default.chunk_group(512, 8) == 2
    assert default.wg_dimension == config_lib.MatmulDimension.N
    _export_shard_map(512, 8192, 8192, 8, config=default)
    with pytest.raises(NotImplementedError, match="along M without the TMA add"):
      _export_shard_map(512, 8192, 8192, 8, config=cfg)
    _export_shard_map(512, 8192, 8192, 8, config=cfg, unverified=True)


def test_interleaved_walk_reaches_the_kernel(monkeypatch):
  # The GPU test compares the two walks' bits, which would also agree if the flag never reached
  # the kernel: here the lowered kernels must differ where the walk does (D = 8) and be the
  # same where it cannot (D = 2: one remote step).
  modules = helpers.record_kernel_modules(monkeypatch)

  def module(d, interleave):
    m, n, k = 64 * d, 512, 256 * d
    cfg = dataclasses.replace(
        defaults.default_config(m=m, n=n, k_shard=k // d, num_devices=d),
        interleave_steps=interleave)
    before = len(modules)
    _export_shard_map(m, n, k, d, config=cfg)
    assert len(modules) == before + 1  # one kernel per program
    return modules[-1]

  for d, differ in ((8, True), (2, False)):
    on, off = (module(d, flag) for flag in (True, False))
    assert (on != off) == differ, d


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("spread", [False, True])
def test_store_variants_lower(spread, prefetch):
  # Config.spread_stores (a tile's stores over the next tile's blocks) at D = 1, with and
  # without the pipeline of pipelines, and the "store" ablation (no TMA stores) and "gemm"
  # (no mainloop).
  cfg = config_lib.Config(tile_m=64, tile_n=256, wg_dimension=config_lib.MatmulDimension.M,
                          max_concurrent_steps=3, prefetch_tiles=prefetch, spread_stores=spread)
  assert cfg.fits_smem(1), cfg
  x = jax.ShapeDtypeStruct((2048, 768), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((768, 1024), jnp.bfloat16)
  for ablate in ((), ("store",), ("gemm",)):
    text = jax.export.export(jax.jit(functools.partial(fused.local_matmul, config=cfg,
                                                       ablate=ablate)),
                             platforms=["cuda"])(x, w).mlir_module()
    assert "mosaic_gpu" in text


def test_spread_stores_lowers_in_the_d8_loopback():
  # Config.spread_stores at D > 1: the previous tile's own or peer stores from the mainloop.
  cfg = config_lib.fit_smem(config_lib.Config(tile_m=128, tile_n=128, spread_stores=True), 8)
  xs = jax.ShapeDtypeStruct((8, 1024, 768), jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((8, 768, 1024), jnp.bfloat16)
  jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter,
                                              config=cfg)), platforms=["cuda"])(xs, ws)
  with pytest.raises(NotImplementedError, match="spread_stores at D > 1"):  # pairs
    cfg.check_shape(m=512, n=1024, k_shard=768, num_devices=8)


@pytest.mark.parametrize("d", [1, 8])
def test_prefetch_tiles_lowers(d):
  # jax's pipeline of pipelines across a CTA's tiles (Config.prefetch_tiles), 12 blocks deep 3
  # and 4: at D = 1 (local) and in the D = 8 loopback (the pairs walk of 64-row chunks).
  for steps in (3, 4):
    cfg = config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=steps,
                            prefetch_tiles=True)
    if d == 1:
      x = jax.ShapeDtypeStruct((2048, 768), jnp.bfloat16)
      w = jax.ShapeDtypeStruct((768, 1024), jnp.bfloat16)
      jax.export.export(jax.jit(functools.partial(fused.local_matmul, config=cfg)),
                        platforms=["cuda"])(x, w)
    else:
      cfg = config_lib.fit_smem(dataclasses.replace(cfg, recv_stages=1), d)
      assert cfg.prefetch_runs(768), cfg  # (4 steps shorten to 3 at D > 1)
      xs = jax.ShapeDtypeStruct((d, 512, 768), jnp.bfloat16)
      ws = jax.ShapeDtypeStruct((d, 768, 1024), jnp.bfloat16)
      jax.export.export(jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter,
                                                  config=cfg)), platforms=["cuda"])(xs, ws)
