"""The fused path on real devices (NVLink transport): needs >= 2 Hopper GPUs in one process.

Skipped elsewhere (no such machine was lent while this was written: see BUILD_NOTES.md). The
rule is the seed's: max relative error vs a float64 reference <= 1.1x the unfused path's
(jnp.dot + psum_scatter) on the same inputs, and chunk i must land on device i.
"""
import dataclasses
import functools

import numpy as np
import pytest

import helpers
import pallas_rs
from pallas_rs import reference
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import defaults
from pallas_rs.kernel import fused
from pallas_rs.bench import shapes
from pallas_rs.bench import testing

pytestmark = pytest.mark.multigpu


def _case(d, m, n, k):
  return shapes.Case(name=f"mg_d{d}_{m}x{n}x{k}", m=m, n=n, k=k, num_devices=d)


def _check(case, seed):
  mesh = helpers.make_mesh(case.num_devices, devices=helpers.hopper_devices())
  inputs = testing.make_inputs(case, seed)
  x, w = testing.put_operands(inputs, mesh, helpers.AXIS)
  op = lambda impl: helpers.shard_mapped(functools.partial(
      pallas_rs.matmul_reduce_scatter, axis_name=helpers.AXIS, implementation=impl), mesh)
  fused = helpers.per_device_shards(op("fused")(x, w), mesh).astype(np.float64)
  unfused = helpers.per_device_shards(op("xla")(x, w), mesh).astype(np.float64)
  ref = helpers.reference_output(inputs)
  e_fused, e_unfused = reference.max_rel_error(fused, ref), reference.max_rel_error(unfused, ref)
  assert e_fused <= 1.1 * e_unfused, (e_fused, e_unfused)


def _device_counts():
  return [d for d in (2, 4, 8) if d <= max(len(helpers.hopper_devices()), 2)]


@pytest.mark.parametrize("d", _device_counts())
@pytest.mark.parametrize("n,k", shapes.SEED_NK_PAIRS)
def test_seed_pairs_scaled(d, n, k):
  _check(_case(d, 64 * d * 2, n // 8, k // 4), seed=d + n % 97)


@pytest.mark.parametrize("d", _device_counts())
def test_smallest_seed_m(d):
  _check(_case(d, 512, 8192, 8192), seed=512 + d)


def test_back_to_back_calls_fresh_inputs():
  d = min(len(helpers.hopper_devices()), 8)
  for i in range(20):
    _check(_case(d, 1024, 1024, 2048), seed=1000 + i)


def _same_bits_over_nvlink(d, m, n, k, base, other, seed, calls=23):
  """`other` gives `base`'s bits over NVLink on `calls` fresh inputs (a race moves bits from
  call to call), and the first 3 keep the error rule against the unfused path."""
  case = _case(d, m, n, k)
  mesh = helpers.make_mesh(d, devices=helpers.hopper_devices())
  op = lambda impl, cfg=None: helpers.shard_mapped(functools.partial(
      pallas_rs.matmul_reduce_scatter, axis_name=helpers.AXIS, implementation=impl,
      config=cfg), mesh)
  for call in range(calls):
    inputs = testing.make_inputs(case, seed + call)
    x, w = testing.put_operands(inputs, mesh, helpers.AXIS)
    got = helpers.per_device_shards(op("fused", other)(x, w), mesh)
    helpers.assert_same_bits(helpers.per_device_shards(op("fused", base)(x, w), mesh), got, call)
    if call < 3:
      ref = helpers.reference_output(inputs)
      unfused = helpers.per_device_shards(op("xla")(x, w), mesh)
      assert reference.max_rel_error(got.astype(np.float64), ref) <= 1.1 * (
          reference.max_rel_error(unfused.astype(np.float64), ref))


@pytest.mark.parametrize("m,n,k", [(512, 2048, 4096), (2048, 8192, 8192)])
def test_tma_add_bit_identical_over_nvlink(m, n, k):
  # D = 2: the peer's partial lands in the owner's output over NVLink and the owner TMA-adds
  # its own onto it once it is announced: the owner's epilogue's bits ("unfused_order").
  # The D = 2 default already adds by TMA: the reference is the same config without it, with
  # the warpgroups along N where the default splits them along M (NVLink refuses the M split
  # without the add: fused.nvlink_unverified; loopback finds the two splits bit-identical:
  # test_kernel_gpu.test_warpgroup_split_changes_no_bit).
  default = config_lib.with_numerics(
      defaults.default_config(m=m, n=n, k_shard=k // 2, num_devices=2), "unfused_order", 2)
  base = config_lib.fit_smem(config_lib.with_wg_along_n(
      dataclasses.replace(default, tma_add=False)), 2)
  added = config_lib.fit_smem(dataclasses.replace(default, tma_add=True), 2)
  assert not base.tma_add and added.tma_add
  assert (base.cta_tile_m, base.cta_tile_n) == (added.cta_tile_m, added.cta_tile_n)
  _same_bits_over_nvlink(2, m, n, k, base, added, 7000 + m, calls=3)


@pytest.mark.parametrize("d", _device_counts())
def test_owner_pull_bit_identical_over_nvlink(d):
  # comm_mode "owner": the owner's epilogue TMA-loads each source's staged partial over NVLink
  # (no comm CTA, no receive slot): the direct push's bits (warpgroups along N, without the TMA
  # add, which NVLink runs: fused.nvlink_unverified); a load before its flag, or an exit while
  # a peer still reads, would move bits.
  m, n, k = 512 * d, 2048, 2048 * d
  base = config_lib.fit_smem(config_lib.with_wg_along_n(dataclasses.replace(
      defaults.default_config(m=m, n=n, k_shard=k // d, num_devices=d), tma_add=False)), d)
  _same_bits_over_nvlink(d, m, n, k, base, dataclasses.replace(base, comm_mode="owner"), 19000)


@pytest.mark.parametrize("d", [d for d in _device_counts() if d > 2])
@pytest.mark.parametrize("numerics", ["unfused_order", "fp32_partials"])
def test_chained_adds_bit_identical_over_nvlink(d, numerics):
  # D > 2 with 4 pulling comm CTAs whose TMA adds chain the peers' partials in ring order
  # (docs/design.md section 3.5): into the output (the ring chain) or into one fp32 receive
  # slot (the sum slot); the direct push's bits (an add before the previous step's landed would
  # move them). Needs four GPUs (nvidia-h200-x4).
  m, n, k = 256 * d, 2048, 1024 * d
  base = config_lib.fit_smem(config_lib.with_numerics(config_lib.with_wg_along_n(
      defaults.default_config(m=m, n=n, k_shard=k // d, num_devices=d)), numerics, d), d)
  chained = dataclasses.replace(base, comm_ctas=4, comm_mode="pull", tma_add=True)
  _same_bits_over_nvlink(d, m, n, k, base, chained, 21000)


@pytest.mark.parametrize("d", [d for d in _device_counts() if d > 2])
def test_chained_adds_with_the_m_split_bit_identical_over_nvlink(d):
  # With the TMA add into the output (the ring's numerics; fp32 partials keep a sum slot that
  # the owner loads, which fused.nvlink_unverified refuses under the M split) NVLink takes the
  # M split: 4 pulling comm CTAs chaining the adds under 128 x 192 CTA tiles of two 64 x 192
  # warpgroup tiles, the direct push's bits with the N split. One rank alone it leaves the
  # compute CTAs 8-37% less work (BUILD_NOTES 2026-12-02); run_multi_gpu.sh pull_wm times it.
  m, n, k = 128 * d, 1536, 1024 * d
  base = config_lib.fit_smem(config_lib.with_numerics(config_lib.with_wg_along_n(
      defaults.default_config(m=m, n=n, k_shard=k // d, num_devices=d)), "unfused_order", d), d)
  m_split = config_lib.fit_smem(dataclasses.replace(
      base, tile_m=64, tile_n=192, wg_dimension=config_lib.MatmulDimension.M, comm_ctas=4,
      comm_mode="pull", tma_add=True), d)
  assert (m_split.cta_tile_m, m_split.cta_tile_n) == (128, 192)
  assert fused.nvlink_unverified(m_split, d) is None
  _same_bits_over_nvlink(d, m, n, k, base, m_split, 22000)


@pytest.mark.parametrize("d", [d for d in _device_counts() if d > 2])
def test_chained_adds_under_64_row_wide_tiles_bit_identical_over_nvlink(d):
  # 64-row chunks (M = 64 D: D = 8's M = 512) without pairs: 64 x 384 CTA tiles (two 64 x 192
  # warpgroup tiles along N) beside 4 pulling comm CTAs chaining the adds in ring order. One
  # D = 8 rank alone they leave Mixtral 9-25% less local work than pairs (BUILD_NOTES
  # 2026-12-02, seventeenth session). The direct push's bits under 64 x 256 tiles.
  m, n, k = 64 * d, 1536, 1024 * d
  make = lambda **kw: config_lib.fit_smem(config_lib.with_numerics(
      config_lib.Config(tile_m=64, wg_dimension=config_lib.MatmulDimension.N, **kw),
      "unfused_order", d), d)
  base = make(tile_n=128)
  wide = config_lib.fit_smem(dataclasses.replace(
      make(tile_n=192, comm_ctas=4, comm_mode="pull"), tma_add=True), d)
  assert (base.comm_mode, base.comm_ctas, base.tma_add) == ("push", 0, False)
  assert (wide.cta_tile_m, wide.cta_tile_n, wide.chunk_group(m, d)) == (64, 384, 1)
  assert fused.nvlink_unverified(wide, d) is None
  _same_bits_over_nvlink(d, m, n, k, base, wide, 22500)


@pytest.mark.parametrize("d", _device_counts())
@pytest.mark.parametrize("numerics", list(config_lib.NUMERICS_MODES))
def test_pairs_split_along_n_bit_identical_over_nvlink(d, numerics):
  # 64-row chunks (M = 64 D) under 128 x 256 CTA tiles whose warpgroups sit along N, each
  # sending one 64-row half and summing the other (the D > 2 default at 64-row chunks: D = 8,
  # M = 512): the bits of 64-row CTA tiles over NVLink, without the TMA add (loopback finds the
  # two bit-identical: test_kernel_gpu.test_pairs_split_along_n_change_no_bit).
  m, n, k = 64 * d, 2048, 1024 * d
  make = lambda **kw: config_lib.fit_smem(dataclasses.replace(config_lib.with_numerics(
      config_lib.Config(**kw), numerics, d), tma_add=False), d)
  base, pairs = make(tile_m=64, tile_n=128), make(tile_m=128, tile_n=128)
  assert (base.chunk_group(m, d), pairs.chunk_group(m, d)) == (1, 2)
  _same_bits_over_nvlink(d, m, n, k, base, pairs, 23000 + 10 * d + len(numerics))
