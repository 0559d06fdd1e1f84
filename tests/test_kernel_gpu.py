"""The fused kernel on one Hopper GPU: loopback (D virtual ranks) and D = 1.

Skipped without a Hopper GPU. Rule (docs/design.md section 2): max relative error vs a float64
reference at most 1.1x that of the unfused path on the same inputs; the unfused path on one
GPU is `reference.loopback_matmul_reduce_scatter` (bf16 partials, bf16 running sum).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import defaults
from pallas_rs.kernel import fused
from pallas_rs import reference
from pallas_rs.bench import shapes
from pallas_rs.bench import testing

pytestmark = pytest.mark.gpu

PAIRS = shapes.SEED_NK_PAIRS
_WG_M = config_lib.MatmulDimension.M
_WG_N = config_lib.MatmulDimension.N


_loopback = jax.jit(fused.loopback_matmul_reduce_scatter)
_unfused = jax.jit(reference.loopback_matmul_reduce_scatter)
_unfused_ring = jax.jit(functools.partial(reference.loopback_matmul_reduce_scatter, order="ring"))


def _check_loopback(d, m, n, k, seed):
  xs, ws = testing.stacked_inputs(seed, d, m, k // d, n)
  ref = testing.stacked_reference(xs, ws)
  out = _loopback(xs, ws)
  assert out.shape == (d, m // d, n)
  e_fused = reference.max_rel_error(out, ref)
  e_xla = reference.max_rel_error(_unfused(xs, ws), ref)
  assert e_fused <= 1.1 * e_xla, (e_fused, e_xla)


def _same_bits(cfgs, d, m, n, k_shard, seed, calls=3):
  """Every config of `cfgs` runs (a rejected one fails here, not skips) and gives the first's
  bits in loopback on `calls` fresh inputs; each output keeps the error rule against the
  unfused path as NCCL sums (ring order)."""
  for cfg in cfgs:
    fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d,
                          config=cfg, loopback=True)
  fns = [jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=c))
         for c in cfgs]
  for call in range(calls):
    xs, ws = testing.stacked_inputs(seed + call, d, m, k_shard, n)
    want, *others = (np.asarray(f(xs, ws)) for f in fns)
    ref = testing.stacked_reference(xs, ws)
    bound = 1.1 * reference.max_rel_error(_unfused_ring(xs, ws), ref)
    assert reference.max_rel_error(want, ref) <= bound
    for got in others:
      helpers.assert_same_bits(want, got, call)


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("n,k", PAIRS)
def test_loopback_scaled_seed_pairs(d, n, k):
  _check_loopback(d, 128 * d, n // 8, k // 4, seed=d * 7 + n % 97)


@pytest.mark.parametrize("d,m,n,k", [(8, 512, 8192, 8192), (8, 2048, 6144, 16384)])
def test_loopback_full_seed_shapes(d, m, n, k):
  _check_loopback(d, m, n, k, seed=m)


def test_back_to_back_fresh_inputs():
  # Stale semaphores or receive slots from a previous call would show up as a wrong result.
  for i in range(20):
    _check_loopback(4, 512, 512, 1024, seed=100 + i)


@pytest.mark.long
def test_thousand_calls():
  f = jax.jit(fused.loopback_matmul_reduce_scatter)
  for i in range(1000):
    d, m, n, k = (8, 512, 1024, 2048) if i % 2 else (4, 1024, 768, 1536)
    xs, ws = testing.stacked_inputs(i, d, m, k // d, n)
    out = f(xs, ws)
    ref = testing.device_reference(xs, ws)
    err = lambda o: float(reference.max_rel_error_on_device(o, ref))
    assert err(out) <= 1.1 * err(_unfused(xs, ws)), i


@pytest.mark.parametrize("m,n,k", [(256, 1024, 2048), (512, 768, 1536), (128, 8192, 1024)])
def test_d1_local_matmul(m, n, k):
  xs, ws = testing.stacked_inputs(m, 1, m, k, n)
  ref = testing.stacked_reference(xs, ws)[0]
  out = jax.jit(fused.local_matmul)(xs[0], ws[0])
  base = jnp.dot(xs[0], ws[0], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  assert reference.max_rel_error(out, ref) <= 1.1 * reference.max_rel_error(base, ref)


def test_nan_shows_where_reference_has_it():
  xs, ws = testing.stacked_inputs(5, 4, 512, 256, 512)
  xs = xs.at[1, 130, 7].set(jnp.nan)
  out = np.asarray(_loopback(xs, ws).astype(jnp.float32))
  ref = testing.stacked_reference(xs, ws)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
  assert np.isnan(out).any()


# Kernel v3's comm CTAs against v1's direct push (comm_ctas=0) in the same numerics mode: the
# same partial tiles and the same owner sum through another transport, so every output bit must
# agree; a race (a staged tile read before it landed, a slot or staging buffer reused too early,
# a batched signal announcing a tile too soon) shows up as a difference. Fresh inputs per call.
V3_COMM = [("push", 2), ("pull", 2), ("pull", 4)]


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("numerics", list(config_lib.NUMERICS_MODES))
@pytest.mark.parametrize("mode,ctas", V3_COMM)
def test_comm_ctas_bit_identical_to_direct_push(d, numerics, mode, ctas):
  m, n, k_shard = 256 * d, 1024, 512
  base = config_lib.with_numerics(
      defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d), numerics, d)
  v3 = config_lib.fit_smem(dataclasses.replace(base, comm_ctas=ctas, comm_mode=mode), d)
  for cfg in (base, v3):  # Both must run: a rejected config is a failure here, not a skip.
    fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d,
                          config=cfg, loopback=True)
  direct = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=base))
  comm = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=v3))
  for call in range(3):
    xs, ws = testing.stacked_inputs(1000 * d + call, d, m, k_shard, n)
    want, got = np.asarray(direct(xs, ws)), np.asarray(comm(xs, ws))
    assert got.shape == (d, m // d, n)
    helpers.assert_same_bits(want, got, call)
    # The unfused path as NCCL sums (ring order): unfused_order is that arithmetic, and
    # against the source-order emulation its error is a coin toss at D >= 4 (measured 1.14x).
    ref = testing.stacked_reference(xs, ws)
    assert reference.max_rel_error(got, ref) <= 1.1 * reference.max_rel_error(
        _unfused_ring(xs, ws), ref)


# The warpgroup tiles side by side along M (config.wg_dimension): 128 x 192 CTA tiles, at D = 1
# and in loopback with the direct push and with pulling comm CTAs (which move each warpgroup's
# 64 x 192 part), checked against the reference; the comm CTAs bit for bit against the push.
@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_warpgroups_split_along_m(d):
  m, n, k_shard = 256 * d, 1536, 512
  base = config_lib.fit_smem(dataclasses.replace(
      defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d), tile_m=64,
      tile_n=192, wg_dimension=config_lib.MatmulDimension.M), d)
  assert (base.cta_tile_m, base.cta_tile_n) == (128, 192)
  xs, ws = testing.stacked_inputs(7 * d, d, m, k_shard, n)
  ref = testing.stacked_reference(xs, ws)
  if d == 1:
    out = jax.jit(functools.partial(fused.local_matmul, config=base))(xs[0], ws[0])
    want = jnp.dot(xs[0], ws[0], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    assert reference.max_rel_error(out, ref[0]) <= 1.1 * reference.max_rel_error(want, ref[0])
    return
  pull = config_lib.fit_smem(dataclasses.replace(base, comm_ctas=2, comm_mode="pull"), d)
  outs = []
  for cfg in (base, pull):
    fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d,
                          config=cfg, loopback=True)
    out = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))(xs, ws)
    assert reference.max_rel_error(out, ref) <= 1.1 * reference.max_rel_error(
        _unfused_ring(xs, ws), ref)
    outs.append(np.asarray(out))
  helpers.assert_same_bits(outs[0], outs[1])


# Pairs (schedule.chunk_group = 2): 64-row chunks, a 128-row CTA tile over the chunks of ranks
# 2p and 2p + 1, each warpgroup's tile to its own destination; three fresh inputs per D, every
# numerics mode, against the reference (D = 8: the per-rank shape of Llama o_proj M = 512).
@pytest.mark.parametrize("numerics", list(config_lib.NUMERICS_MODES))
@pytest.mark.parametrize("d,n,k_shard", [(2, 1024, 512), (4, 1536, 512), (8, 8192, 1024)])
def test_pairs_of_64_row_chunks(d, n, k_shard, numerics):
  m = 64 * d
  cfg = config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(
      tile_m=64, tile_n=256 if n % 256 == 0 else 192,
      wg_dimension=config_lib.MatmulDimension.M), numerics, d), d)
  assert cfg.chunk_group(m, d) == 2
  fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d,
                        config=cfg, loopback=True)
  f = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
  for call in range(3):
    xs, ws = testing.stacked_inputs(100 * d + call, d, m, k_shard, n)
    ref = testing.stacked_reference(xs, ws)
    out = f(xs, ws)
    assert reference.max_rel_error(out, ref) <= 1.1 * reference.max_rel_error(
        _unfused_ring(xs, ws), ref), call


# The same pairs with the warpgroups side by side along N (128 x 128 warpgroup tiles over both
# chunks, a destination per 64-row half: the D > 2 default, since NVLink refuses the M split
# without the TMA add): every output bit as with the M split and as with 64-row CTA tiles (the
# same products and sums, other hands), every numerics mode, three fresh inputs each.
@pytest.mark.parametrize("numerics", list(config_lib.NUMERICS_MODES))
@pytest.mark.parametrize("d,n,k_shard", [(2, 1024, 512), (4, 1536, 512), (8, 8192, 1024)])
def test_pairs_split_along_n_change_no_bit(d, n, k_shard, numerics):
  m = 64 * d
  make = lambda **kw: config_lib.fit_smem(config_lib.with_numerics(
      config_lib.Config(**kw), numerics, d), d)
  cfgs = [make(tile_m=128, tile_n=128), make(tile_m=64, tile_n=256, wg_dimension=_WG_M),
          make(tile_m=64, tile_n=128)]
  assert [c.chunk_group(m, d) for c in cfgs] == [2, 2, 1]
  _same_bits(cfgs, d, m, n, k_shard, seed=15000 + 10 * d + len(numerics))


# tma_add (D = 2, the ring's numerics): the peer's partial lands in the owner's output and the
# owner TMA-adds its own, rounded to bf16, onto it: the owner's epilogue's arithmetic, so every
# output bit must agree with it (an add issued before the peer's partial landed, or a partial
# overwriting an added tile, shows up as a difference). Pairs (M = 128) and both warpgroup
# splits included; fresh inputs per call.
@pytest.mark.parametrize("m,n,k_shard,tiles", [
    (512, 1024, 512, None), (2048, 2048, 1024, None), (128, 1024, 512, (64, 256, _WG_M)),
    (1024, 1536, 512, (64, 192, _WG_M))])
def test_tma_add_bit_identical_to_the_owner_epilogue(m, n, k_shard, tiles):
  d = 2
  base = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
  if tiles:
    base = dataclasses.replace(base, tile_m=tiles[0], tile_n=tiles[1], wg_dimension=tiles[2])
  base = config_lib.with_numerics(base, "unfused_order", d)
  # The D = 2 default already adds by TMA: the reference is the same config without it.
  added = config_lib.fit_smem(dataclasses.replace(base, tma_add=True), d)
  base = config_lib.fit_smem(dataclasses.replace(base, tma_add=False), d)
  assert not base.tma_add and added.tma_add
  for cfg in (base, added):  # Both must run: a rejected config is a failure here, not a skip.
    fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d,
                          config=cfg, loopback=True)
  assert (m == 128) == (added.chunk_group(m, d) == 2)  # pairs at 64-row chunks
  owner = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=base))
  add_fn = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=added))
  for call in range(3):
    xs, ws = testing.stacked_inputs(5000 + m + call, d, m, k_shard, n)
    got = np.asarray(add_fn(xs, ws))
    helpers.assert_same_bits(owner(xs, ws), got, call)
    ref = testing.stacked_reference(xs, ws)
    assert reference.max_rel_error(got, ref) <= 1.1 * reference.max_rel_error(
        _unfused_ring(xs, ws), ref)


# The same CTA tile with the warpgroups along M (two 64 x 256 wgmma tiles) or along N (two
# 128 x 128): every output bit the same, so the N split (which runs over NVLink) stands in as
# the reference where NVLink refuses the M split without the TMA add (fused.nvlink_unverified).
@pytest.mark.parametrize("d,numerics", [(2, "unfused_order"), (2, "fp32_partials"),
                                        (4, "fp32_partials")])
def test_warpgroup_split_changes_no_bit(d, numerics):
  m, n, k_shard = 1024 * d, 2048, 1024
  cfgs = [config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(
      tile_m=tm, tile_n=tn, wg_dimension=wg), numerics, d), d)
      for tm, tn, wg in ((64, 256, _WG_M), (128, 128, config_lib.MatmulDimension.N))]
  assert {(c.cta_tile_m, c.cta_tile_n) for c in cfgs} == {(128, 256)}
  fns = [jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=c))
         for c in cfgs]
  for call in range(3):
    xs, ws = testing.stacked_inputs(13000 + 10 * d + call, d, m, k_shard, n)
    helpers.assert_same_bits(*(f(xs, ws) for f in fns), call)


# 128 x 192 CTA tiles split along N (two 128 x 96 wgmma tiles: both operands at the 64 B
# swizzle, Config.operand_swizzle_cols) against the same CTA tile split along M (64 x 192 each,
# the 128 B swizzle): every bit the same, at the Mixtral shape they are for (N = 6144, M = 512:
# 32 x 4 CTA tiles fill 128 of 132 SMs where 128 x 256 fills 96), and at D = 2 with the ring.
@pytest.mark.parametrize("d,m,numerics", [(2, 1024, "unfused_order"),
                                          (4, 512, "fp32_partials"), (8, 512, "fp32_partials")])
def test_96_column_warpgroup_tiles_change_no_bit(d, m, numerics):
  n, k_shard = 6144, 1024
  cfgs = [config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(
      tile_m=tm, tile_n=tn, epi_tile_n=32, wg_dimension=wg), numerics, d), d)
      for tm, tn, wg in ((64, 192, _WG_M), (128, 96, _WG_N))]
  assert [c.operand_swizzle_cols for c in cfgs] == [64, 32]
  assert {(c.cta_tile_m, c.cta_tile_n) for c in cfgs} == {(128, 192)}
  _same_bits(cfgs, d, m, n, k_shard, seed=13500 + 10 * d)


# 64-row CTA tiles 256 and 384 wide (warpgroups along N) with pulling comm CTAs chaining their
# adds in ring order: how D = 8's 64-row chunks run without pairs (64 x 384 took 9-25% off
# Mixtral M = 512's local work, one rank alone: BUILD_NOTES 2026-12-02, seventeenth session).
# Every bit the same whatever the tile width or the number of pulling CTAs.
def test_64_row_wide_tiles_with_pulling_ctas_change_no_bit():
  d, m, n, k_shard = 8, 512, 6144, 768
  base = config_lib.with_numerics(config_lib.Config(
      tile_m=64, wg_dimension=_WG_N, comm_mode="pull", comm_ctas=4), "unfused_order", d)
  cfgs = [dataclasses.replace(base, tile_n=tile_n, comm_ctas=ctas, tma_add=True,
                              interleave_steps=True)
          for tile_n, ctas in ((128, 4), (192, 4), (192, 2))]
  assert [(c.cta_tile_m, c.cta_tile_n) for c in cfgs] == [(64, 256), (64, 384), (64, 384)]
  _same_bits(cfgs, d, m, n, k_shard, seed=14800)


# The remote steps walked tile by tile (Config.interleave_steps) change only when each tile is
# computed, not what it adds: every output bit as with the step-major walk, at D = 3/4/8, with
# the direct push (one-row chunks: the shapes it is for), pulling comm CTAs and pairs.
@pytest.mark.parametrize("d,m,comm", [(3, 192, {}), (4, 512, {}), (8, 512, {}),
                                      (4, 1024, dict(comm_ctas=2, comm_mode="pull")),
                                      (8, 512, dict(tile_m=64, tile_n=256,
                                                    wg_dimension=_WG_M))])
def test_interleaved_steps_change_no_bit(d, m, comm):
  n, k_shard = 1024, 512
  base = dataclasses.replace(defaults.default_config(m=m, n=n, k_shard=k_shard,
                                                       num_devices=d), **comm)
  base = config_lib.fit_smem(base, d)
  _same_bits([dataclasses.replace(base, interleave_steps=flag) for flag in (False, True)],
             d, m, n, k_shard, seed=14000 + 10 * d)


# The tile order within a step (grid_minor_dim / grid_tile_width; the default takes row bands 8
# tiles high where they cut a wave's reads: defaults._tile_order) changes when a tile is
# computed, not what it adds: every bit as with column bands, with partial bands (width 3), at
# D = 2 and 4, with the direct push and with pulling comm CTAs.
@pytest.mark.parametrize("d,m,comm", [(2, 2048, {}), (4, 4096, {}),
                                      (4, 4096, dict(comm_ctas=2, comm_mode="pull"))])
def test_tile_order_changes_no_bit(d, m, comm):
  n, k_shard = 1536, 512
  base = config_lib.fit_smem(dataclasses.replace(defaults.default_config(
      m=m, n=n, k_shard=k_shard, num_devices=d), **comm), d)
  orders = [(_WG_M, 8), (_WG_M, 3), (_WG_N, 1), (_WG_N, 4)]
  _same_bits([dataclasses.replace(base, grid_minor_dim=minor, grid_tile_width=width)
              for minor, width in orders], d, m, n, k_shard, seed=14500 + 10 * d)


# tma_add at D > 2 (docs/design.md section 3.5): pulling comm CTAs store the first partial into
# the output and TMA-add the others as they arrive, in ring order (the stagger's arrival order);
# the owner TMA-adds its own. Every bit as the owner's epilogue summing the receive slots in
# ring order (with comm CTAs and with the direct push), the error rule, and, over alternating
# shapes and fresh inputs, no call that differs (an add out of order or before its partial
# landed would move bits from call to call).
@pytest.mark.parametrize("d,m,ctas", [(3, 768, 2), (4, 1024, 2), (4, 512, 4), (8, 1024, 2)])
def test_ring_chain_of_comm_ctas_changes_no_bit(d, m, ctas):
  n, k_shard = 1024, 512
  direct = config_lib.fit_smem(config_lib.with_numerics(defaults.default_config(
      m=m, n=n, k_shard=k_shard, num_devices=d), "unfused_order", d), d)
  slots = config_lib.fit_smem(dataclasses.replace(direct, comm_ctas=ctas, comm_mode="pull"), d)
  added = dataclasses.replace(slots, tma_add=True)
  _same_bits([direct, slots, added], d, m, n, k_shard, seed=15000 + 10 * d)


@pytest.mark.parametrize("numerics", ["unfused_order", "fp32_partials"])
def test_ring_chain_back_to_back_calls(numerics):
  fns = {}
  for d, m, ctas in ((4, 1024, 2), (8, 1024, 2)):
    base = config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(
        comm_ctas=ctas, comm_mode="pull"), numerics, d), d)
    fns[d] = [jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
              for cfg in (base, dataclasses.replace(base, tma_add=True))]
  for call in range(60):
    d, m = (8, 1024) if call % 2 else (4, 1024)
    xs, ws = testing.stacked_inputs(16000 + call, d, m, 512, 768)
    helpers.assert_same_bits(*(f(xs, ws) for f in fns[d]), call)


# tma_add with fp32 partials at D > 2 (Config.sum_slot, docs/design.md section 3.5): pulling
# comm CTAs store the first fp32 partial into receive slot 0 and TMA-add the others onto it in
# ring order; the owner loads that one sum and adds its own accumulator last, as the owner's
# epilogue adds the D - 1 slots in ring order. Every bit the same, subnormal partials included
# (a TMA add that flushed them, or a register add that did, would differ there).
@pytest.mark.parametrize("d,m,ctas", [(3, 768, 2), (4, 1024, 2), (4, 512, 4), (8, 1024, 2)])
def test_fp32_sum_slot_of_comm_ctas_changes_no_bit(d, m, ctas):
  n, k_shard = 1024, 512
  direct = config_lib.fit_smem(config_lib.with_numerics(dataclasses.replace(
      defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d), tma_add=False),
      "fp32_partials", d), d)
  slots = config_lib.fit_smem(dataclasses.replace(direct, comm_ctas=ctas, comm_mode="pull"), d)
  added = dataclasses.replace(slots, tma_add=True)
  assert added.sum_slot and not slots.tma_add
  _same_bits([direct, slots, added], d, m, n, k_shard, seed=19000 + 10 * d)
  fns = [jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=c))
         for c in (direct, added)]
  xs, ws = testing.stacked_inputs(19500 + d, d, m, k_shard, n)
  tiny = (xs * 2.0**-68).astype(xs.dtype), (ws * 2.0**-68).astype(ws.dtype)
  want, got = (np.asarray(f(*tiny)) for f in fns)
  assert np.any(want != 0), "the partials underflowed to zero: the check would prove nothing"
  helpers.assert_same_bits(want, got, "subnormal")


# Inputs scaled down to where the partials and sums are fp32 subnormals, or round to bf16
# zero: the rule still holds in every numerics mode (on the GPU both paths' conversion to
# bf16 gives 0 for a subnormal; the fp32 sums keep what the bf16 partials lose).
@pytest.mark.parametrize("d,m", [(2, 512), (4, 1024), (8, 1024)])
def test_tiny_inputs_keep_the_rule(d, m):
  n, k_shard = 1024, 512
  xs, ws = testing.stacked_inputs(19500 + d, d, m, k_shard, n)
  fns = {mode: jax.jit(functools.partial(
      fused.loopback_matmul_reduce_scatter, config=config_lib.fit_smem(config_lib.with_numerics(
          defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d), mode, d), d)))
      for mode in config_lib.NUMERICS_MODES}
  for scale in (-60, -66, -68):
    x, w = (xs * 2.0**scale).astype(xs.dtype), (ws * 2.0**scale).astype(ws.dtype)
    ref = testing.stacked_reference(x, w)
    assert 0 < np.abs(np.asarray(ref)).max() < 2.0**-126 * 2**10
    e_unfused = reference.max_rel_error(_unfused_ring(x, w), ref)
    for mode, f in fns.items():
      e_fused = reference.max_rel_error(f(x, w), ref)
      assert e_fused <= 1.1 * e_unfused, (scale, mode, e_fused, e_unfused)


def test_tma_add_of_f32_is_the_fp32_add():
  """The primitive the sum slot rests on: a TMA reduce-add of f32 SMEM onto f32 GMEM gives
  fl32(a + b) bit for bit, subnormals, cancellations and infinities included (numpy's IEEE
  round-to-nearest add, no flush to zero)."""
  import jax.experimental.pallas as pl  # pylint: disable=g-import-not-at-top
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  shape = (64, 128)

  def body(a_gmem, b_gmem, out_gmem):
    def scoped(smem, barrier):
      for i, src in enumerate((a_gmem, b_gmem)):
        plgpu.copy_gmem_to_smem(src, smem.at[i], barrier.at[i])
        plgpu.barrier_wait(barrier.at[i])
      plgpu.copy_smem_to_gmem(smem.at[0], out_gmem)
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)
      plgpu.copy_smem_to_gmem(smem.at[1], out_gmem, reduction_op="add")
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    pl.run_scoped(scoped, plgpu.SMEM((2, *shape), jnp.float32), plgpu.Barrier(num_barriers=2))

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(shape, jnp.float32),
                   compiler_params=fused._compiler_params())
  rng = np.random.default_rng(0)
  with np.errstate(over="ignore"):  # (some overflow to infinities, on purpose)
    a, b = ((rng.standard_normal(shape) * np.exp2(rng.integers(-149, 128, shape)))
            .astype(np.float32) for _ in range(2))
  b[::4] = -a[::4] * np.float32(1 + 2.0**-23)  # cancellations
  b[1::4] = (a[1::4] * 2.0**-24).astype(np.float32)  # ties and sticky bits
  a[2::8], b[2::8] = 2.0**-140, 2.0**-141  # subnormal + subnormal
  a[3::8, :64], b[3::8, :64] = np.float32(2.0**-126), -np.float32(2.0**-127)  # to a subnormal
  with np.errstate(over="ignore", invalid="ignore"):
    want = a + b
  got = np.asarray(jax.jit(f)(a, b))
  assert np.count_nonzero((want != 0) & (np.abs(want) < 2.0**-126)) > 100
  assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.argwhere(
      got.view(np.uint32) != want.view(np.uint32))[:5]


# comm_mode "owner" (docs/design.md section 3.2): no comm CTAs, remote tiles staged locally and
# flagged to the owner, whose own epilogue loads each source's staged partial. The same
# arithmetic as the receive slots, so every bit as the direct push, in every numerics mode.
@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("numerics", list(config_lib.NUMERICS_MODES))
def test_owner_pull_bit_identical_to_direct_push(d, numerics):
  m, n, k_shard = 256 * d, 1024, 512
  base = config_lib.fit_smem(config_lib.with_numerics(dataclasses.replace(
      defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d), tma_add=False),
      numerics, d), d)
  _same_bits([base, dataclasses.replace(base, comm_mode="owner")], d, m, n, k_shard,
             seed=17000 + 100 * d)


def test_owner_pull_back_to_back_calls():
  # An owner that loads a partial before its source staged it, or a rank that exits while a
  # peer still reads its staging, moves bits from call to call: 60 calls alternating D = 2
  # (TMA add off: the default adds) and D = 8, fresh inputs, every bit against the direct push.
  fns = {}
  for d, m in ((2, 1024), (8, 1024)):
    base = config_lib.fit_smem(dataclasses.replace(defaults.default_config(
        m=m, n=768, k_shard=512, num_devices=d), tma_add=False), d)
    fns[d] = [jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=c))
              for c in (base, dataclasses.replace(base, comm_mode="owner"))]
  for call in range(60):
    d = 8 if call % 2 else 2
    xs, ws = testing.stacked_inputs(18000 + call, d, 1024, 512, 768)
    helpers.assert_same_bits(*(f(xs, ws) for f in fns[d]), call)


def test_tma_add_back_to_back_calls():
  # A TMA add issued before the peer's partial landed, or a partial landing on an added tile,
  # would move the output from call to call: 100 calls alternating two shapes, fresh inputs,
  # every bit against the owner's epilogue.
  fns = {}
  for m, n, k_shard in ((512, 1024, 512), (1024, 768, 1024)):
    base = config_lib.with_numerics(
        defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=2), "unfused_order", 2)
    assert base.tma_add  # the D = 2 default
    fns[m] = [jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
              for cfg in (dataclasses.replace(base, tma_add=False), base)]
  for call in range(100):
    m, n, k_shard = (512, 1024, 512) if call % 2 else (1024, 768, 1024)
    xs, ws = testing.stacked_inputs(9000 + call, 2, m, k_shard, n)
    helpers.assert_same_bits(*(f(xs, ws) for f in fns[m]), call)


@pytest.mark.parametrize("split", ["M", "N"])
def test_pairs_back_to_back_calls(split):
  # Pairs at D = 8 and D = 4 (along M the summing warpgroup uses both warpgroups' receive
  # stages; along N each warpgroup sends one half and sums the other): 60 calls alternating
  # the two, fresh inputs each, the error rule every call and the same inputs twice every 10th
  # call (a race moves the bits).
  fns = {}
  for d, n, k_shard in ((8, 2048, 512), (4, 1536, 512)):
    tiles = (dict(tile_m=64, tile_n=256 if n % 256 == 0 else 192, wg_dimension=_WG_M)
             if split == "M" else dict(tile_m=128, tile_n=128))
    cfg = config_lib.fit_smem(config_lib.with_numerics(config_lib.Config(**tiles),
                                                       defaults.default_numerics(d), d), d)
    assert cfg.chunk_group(64 * d, d) == 2
    fns[d] = (jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg)),
              n, k_shard)
  for call in range(60):
    d = 8 if call % 2 else 4
    f, n, k_shard = fns[d]
    xs, ws = testing.stacked_inputs(11000 + call, d, 64 * d, k_shard, n)
    out = np.asarray(f(xs, ws))
    ref = testing.stacked_reference(xs, ws)
    assert reference.max_rel_error(out, ref) <= 1.1 * reference.max_rel_error(
        _unfused_ring(xs, ws), ref), call
    if call % 10 == 0:
      helpers.assert_same_bits(out, f(xs, ws), call)


# Config.prefetch_tiles (jax's pipeline of pipelines across a CTA's tiles) changes when blocks
# are loaded, not what is added: every bit as without it in loopback, with the direct push and
# pulling comm CTAs, several tiles per CTA (k_shard 768: 12 blocks, 3 and 4 steps), and at D = 1.
@pytest.mark.parametrize("d,m,comm", [(2, 2048, {}), (4, 2048, dict(comm_ctas=2, comm_mode="pull")),
                                      (8, 4096, dict(max_concurrent_steps=4))])
def test_prefetch_tiles_change_no_bit(d, m, comm):
  n, k_shard = 1536, 768
  base = config_lib.fit_smem(dataclasses.replace(defaults.default_config(
      m=m, n=n, k_shard=k_shard, num_devices=d), **comm), d)
  assert base.prefetch_runs(k_shard), base
  _same_bits([dataclasses.replace(base, prefetch_tiles=flag) for flag in (False, True)],
             d, m, n, k_shard, seed=15000 + 10 * d)


# Config.spread_stores changes when the output leaves (over the next tile's blocks), not the
# sum (each block added in order into one accumulator, rounded once): every bit as without it.
@pytest.mark.parametrize("prefetch", [False, True])
def test_spread_stores_at_d1_change_no_bit(prefetch):
  xs, ws = testing.stacked_inputs(15200 + prefetch, 1, 2048, 768, 1536)
  ref = testing.stacked_reference(xs, ws)[0]
  base = jnp.dot(xs[0], ws[0], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  for tile_m, tile_n, wg, steps in ((128, 128, config_lib.MatmulDimension.N, 3),
                                    (64, 192, config_lib.MatmulDimension.M, 4)):
    off, on = (np.asarray(fused.local_matmul(xs[0], ws[0], config=config_lib.Config(
        tile_m=tile_m, tile_n=tile_n, wg_dimension=wg, max_concurrent_steps=steps,
        prefetch_tiles=prefetch, spread_stores=flag))) for flag in (False, True))
    assert reference.max_rel_error(off, ref) <= 1.1 * reference.max_rel_error(base, ref)
    helpers.assert_same_bits(off, on)


# Config.spread_stores at D > 1: a tile's stores (the own chunk's into the output, a peer's
# towards its owner) leave during the CTA's next tile and its signal follows them at the next
# epilogue: when, not what. Every bit as without it in loopback: the direct push (D = 2 with
# the owner's TMA add, whose own tiles leave at once; D = 8), pulling comm CTAs and "owner"
# (D = 4's fp32 partials on 64 x 128 warpgroup tiles: a whole 128 x 128 one does not fit SMEM).
@pytest.mark.parametrize("d,m,comm", [(2, 2048, {}), (4, 2048, dict(comm_ctas=2, comm_mode="pull")),
                                      (4, 2048, dict(comm_mode="owner", tma_add=False)),
                                      (8, 4096, {})])
def test_spread_stores_change_no_bit(d, m, comm):
  n, k_shard = 1536, 768
  base = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
  if d == 4:
    base = config_lib.with_tile(base, 64, 128)
  base = config_lib.fit_smem(dataclasses.replace(base, eager_signal_steps=0, **comm), d)
  spread = config_lib.fit_smem(dataclasses.replace(base, spread_stores=True), d)
  assert spread.spread_stores and spread.chunk_group(m, d) == 1, spread
  _same_bits([base, spread], d, m, n, k_shard, seed=15300 + 10 * d + len(comm))


# Config.recv_stages (the owner's receive prefetch, which fit_smem gives back where a shed
# pipeline step leaves room: BUILD_NOTES 2026-12-07, 106th) changes when received partials are
# loaded, not what is added: every bit as with one stage, at D = 4 (fp32 partials) and D = 8
# (bf16), the ping-pong's 5-step ring at D = 8 too.
@pytest.mark.parametrize("d,m,pingpong", [(4, 2048, False), (8, 4096, False), (8, 4096, True)])
def test_receive_stages_change_no_bit(d, m, pingpong):
  n, k_shard = 1536, 768
  base = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
  base = config_lib.fit_smem(dataclasses.replace(
      base, max_concurrent_steps=5 if pingpong else 2, recv_stages=3, pingpong=pingpong,
      prefetch_tiles=False, tma_add=False, comm_ctas=0, comm_mode="push"), d)
  cfgs = [dataclasses.replace(base, recv_stages=r) for r in range(1, base.recv_stages + 1)]
  assert len(cfgs) >= 2 and not base.sum_in_output, base
  _same_bits(cfgs, d, m, n, k_shard, seed=15400 + 10 * d + pingpong)


def test_prefetch_tiles_at_d1_change_no_bit():
  x, w = testing.generate(15100, 2048, 768, 1536)
  outs = [np.asarray(fused.local_matmul(x, w, config=config_lib.Config(
      tile_m=128, tile_n=128, max_concurrent_steps=steps, prefetch_tiles=flag)))
      for steps in (3, 4) for flag in (False, True)]
  for got in outs[1:]:
    helpers.assert_same_bits(outs[0], got)
