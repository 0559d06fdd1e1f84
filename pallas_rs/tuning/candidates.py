"""Candidate kernel configs for the tuner (experiments/autotune.py), likeliest winners first.

`candidate_configs` orders `search_space` (every valid config of a shape) for diversity around
`defaults.default_config`;
`comm_variants` are one config's ways of moving the partials (direct push, comm CTAs pulling
or pushing); `tile_variants` its CTA tile shapes (small M: how many SMs one wave fills, and
how many waves the transfer can overlap); `order_variants` its tile orders (large M: what a
wave reads); `prefetch_variants` it with Config.prefetch_tiles switched (and at a depth one
step either way); `spread_variants` with Config.spread_stores switched;
`ag_tile_variants` the same for the backward's
all-gather matmul (jax's kernel: `pallas_rs.kernel.ag_matmul`); `adapt_config` carries a
config measured at one D to another (the loopback entries).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterator

from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import defaults

Config = config_lib.Config

# Fields varied one at a time around the default, in this priority order; each
# value list is ordered nearest-first.
_VARIANT_FIELDS = ("comm_ctas", "out_slots", "tile_m", "tile_n", "wg_dimension", "grid_minor_dim",
                   "grid_tile_width", "max_concurrent_steps", "spread_stores", "recv_stages",
                   "eager_signal_steps")
# Fields that change nothing at D = 1 (no receive buffers, no signals).
_MULTI_DEVICE_FIELDS = ("comm_ctas", "out_slots", "recv_stages", "eager_signal_steps")


def candidate_configs(*, m: int, n: int, k_shard: int, num_devices: int,
                      max_configs: int | None = None,
                      num_sms: int = config_lib.DEFAULT_NUM_SMS) -> list[Config]:
  """`default_config` first, then `search_space` ordered for diversity.

  Deterministic. After the default come configs differing from it in one field
  (tile_m, then tile_n, wg_dimension, grid_minor_dim, grid_tile_width, max_concurrent_steps,
  recv_stages, eager_signal_steps: one variant of each field before a second of any), then two
  fields, and so on; so the first few cover every axis once. Every config is
  valid for the shape and within the SMEM limit. Empty if the kernel cannot
  take the shape.
  """
  try:
    default = defaults.default_config(m=m, n=n, k_shard=k_shard,
                                      num_devices=num_devices, num_sms=num_sms)
  except NotImplementedError:
    return []
  space = list(search_space(m=m, n=n, k_shard=k_shard, num_devices=num_devices,
                            num_sms=num_sms))
  fields = [f for f in _VARIANT_FIELDS
            if not (f in _MULTI_DEVICE_FIELDS and num_devices == 1)]
  if num_devices == 1:
    # recv_stages allocates nothing at D = 1: configs differing only in it are
    # the same kernel, so take the default's value.
    space = [dataclasses.replace(c, recv_stages=default.recv_stages) for c in space]

  def diff(cfg):
    return [f for f in fields if getattr(cfg, f) != getattr(default, f)]

  def distance(cfg, f):
    a, b = int(getattr(cfg, f)), int(getattr(default, f))
    return abs(math.log2(a / b)) if a > 0 and b > 0 else 1.0

  # rank[f][value]: 0 for the default's value, then nearest values first.
  rank = {}
  for f in fields:
    values = sorted({int(getattr(c, f)) for c in space} | {int(getattr(default, f))},
                    key=lambda v, f=f: (v != int(getattr(default, f)),
                                        distance(dataclasses.replace(default, **{f: v}), f)
                                        if f not in ("grid_minor_dim", "wg_dimension",
                                                     *config_lib.BOOL_FIELDS) else 0,
                                        v))
    rank[f] = {v: i for i, v in enumerate(values)}

  def sort_key(cfg):
    d = diff(cfg)
    # Fewer changed fields first; among those, nearer values (so one variant of
    # every field comes before a second variant of any), then field priority.
    return (len(d), sum(rank[f][int(getattr(cfg, f))] for f in d),
            tuple(fields.index(f) for f in d),
            tuple(int(getattr(cfg, f)) for f in fields))

  ordered = [default]
  seen = {default}
  for cfg in sorted(space, key=sort_key):
    if cfg not in seen:
      seen.add(cfg)
      ordered.append(cfg)
  if max_configs is not None and max_configs > 0:
    ordered = ordered[:max_configs]
  return ordered


def adapt_config(cfg: Config, *, m: int, n: int, k_shard: int,
                 num_devices: int) -> Config | None:
  """`cfg` made to fit another D: recv_stages for D > 1, tile_m for the chunk,
  fewer pipeline stages for SMEM. None if it still does not fit."""
  cand = cfg
  if num_devices > 1 and cand.recv_stages < 2:
    cand = dataclasses.replace(cand, recv_stages=2)
  if (m // num_devices) % cand.tile_m:
    cand = dataclasses.replace(cand, tile_m=64)
  while not cand.fits_smem(num_devices) and cand.max_concurrent_steps > 2:
    cand = dataclasses.replace(cand, max_concurrent_steps=cand.max_concurrent_steps - 1)
  cand = _prefetch_kept(cand, k_shard)
  try:
    cand.check_shape(m=m, n=n, k_shard=k_shard, num_devices=num_devices)
  except NotImplementedError:
    return None
  return cand


def _prefetch_kept(cfg: Config, k_shard: int) -> Config:
  """`cfg` with prefetch_tiles kept where it can still run (a pipeline shortened to fit SMEM
  may no longer divide the k_shard's blocks): the config stays, without it."""
  if cfg.prefetch_tiles and not cfg.prefetch_runs(k_shard):
    return dataclasses.replace(cfg, prefetch_tiles=False)
  return cfg


# (comm_mode, comm_ctas) tried by comm_variants: the direct push, the owner's epilogue loading
# the staged partials (no comm CTA; ninth session, not yet measured over NVLink), pulling comm
# CTAs, which beat pushing ones once their signals are batched (BUILD_NOTES 2026-12-01: ~36-40
# vs ~24 GB/s; push 8 stays as a check), 16 of them for the shapes whose transfer needs the
# whole link (D = 8's o_proj).
COMM_VARIANTS = (("push", 0), ("owner", 0), ("pull", 2), ("pull", 4), ("pull", 8), ("pull", 16),
                 ("push", 8))


def comm_variants(base: Config, *, m: int, n: int, k_shard: int, num_devices: int,
                  pull: bool = True) -> list[Config]:
  """`base` (its tiles, pipeline, numerics and owner's sum kept) with each way of moving the
  partials in COMM_VARIANTS (comm_ctas 0 is v1's direct push), fitted to SMEM; those the kernel
  cannot take for the shape left out; `pull=False` leaves out those that read peers (pulling
  comm CTAs and "owner": jax < 0.11.2).
  `base` itself (the incumbent) comes first when the kernel takes it. At D > 2 the TMA add goes
  with the pulling ones in the ring's numerics and with fp32 partials (their adds in ring
  order: the same bits, 2-11% faster in loopback where the owner's tail is the bottleneck) and
  cannot go without them (config.tma_add_runs)."""
  def moved(mode, ctas):
    cfg = dataclasses.replace(base, comm_mode=mode, comm_ctas=ctas, tma_add=False)
    return dataclasses.replace(cfg, tma_add=cfg.tma_add_can_run(num_devices) and (
        base.tma_add or num_devices > 2))

  configs = [moved(mode, ctas)
             for mode, ctas in ((base.comm_mode, base.comm_ctas), *COMM_VARIANTS)]
  return _fitting([c for c in configs if pull or not c.reads_peers],
                  m=m, n=n, k_shard=k_shard, num_devices=num_devices)


def owner_variants(base: Config, *, m: int, n: int, k_shard: int,
                   num_devices: int) -> list[Config]:
  """`base` (the incumbent) first, then `base` with the owner's sum by TMA add switched over
  where it runs (Config.tma_add, config.tma_add_runs: the same bits), fitted to SMEM; those the
  kernel cannot take for the shape left out."""
  other = ([dataclasses.replace(base, tma_add=not base.tma_add)]
           if base.tma_add_can_run(num_devices) else [])
  return _fitting([base, *other], m=m, n=n, k_shard=k_shard, num_devices=num_devices)


def _fitting(configs, *, m: int, n: int, k_shard: int, num_devices: int) -> list[Config]:
  """`configs` fitted to SMEM, without those the kernel cannot take for the shape and without
  repeats, in order."""
  out = []
  for cfg in configs:
    cfg = _prefetch_kept(config_lib.fit_smem(cfg, num_devices), k_shard)
    try:
      cfg.check_shape(m=m, n=n, k_shard=k_shard, num_devices=num_devices)
    except NotImplementedError:
      continue
    if cfg not in out:
      out.append(cfg)
  return out


# (tile_m, tile_n, wg_dimension) tried by tile_variants: CTA tiles 128 x 256, 64 x 256, 128 x 128
# (warpgroups side by side along N), 128 x 256, 128 x 192, 128 x 128 and 256 x 128 (along M),
# then 64 x 384 (along N). At small M the tile count decides how full one wave is (Mixtral w2
# M = 512 at D = 2: 96 tiles of 128 x 256 on 132 SMs, 128 of 128 x 192: 79 vs 66 us on one H200)
# and whether there is a second wave for the transfer to hide under (128 x 128: two waves where
# 128 x 256 makes one). 64 x 384 is for 64-row chunks without pairs (D = 8, M = 512): one wave of
# 128 tiles beside four pulling CTAs, 9-25% less local work than the table's pairs on Mixtral
# (one rank alone, BUILD_NOTES 2026-12-02, seventeenth session); last, so that lists cut at
# --max_configs (ag_tile_variants) keep the tiles they had.
TILE_VARIANTS = ((128, 128, "N"), (64, 128, "N"), (128, 64, "N"), (64, 256, "M"),
                 (64, 192, "M"), (64, 128, "M"), (128, 128, "M"), (64, 192, "N"))


def tile_variants(base: Config, *, m: int, n: int, k_shard: int, num_devices: int,
                  tma_add: bool | None = None) -> list[Config]:
  """`base` (its comm path, pipeline and numerics kept) with each CTA tile of TILE_VARIANTS,
  fitted to SMEM; those the kernel cannot take for the shape left out; `base` itself (the
  incumbent) first when the kernel takes it. `tma_add` (None: the base's) sets the challengers'
  owner's sum, `base`'s tiles with it among them, so that one retune weighs both."""
  challenger = base if tma_add is None else dataclasses.replace(base, tma_add=tma_add)
  return _fitting([base, challenger] + [
      config_lib.with_tile(challenger, tile_m, tile_n, config_lib.MatmulDimension[wg])
      for tile_m, tile_n, wg in TILE_VARIANTS], m=m, n=n, k_shard=k_shard,
      num_devices=num_devices)


# Tile orders (grid_minor_dim, grid_tile_width) tried by order_variants: column bands one and
# four tiles wide, row bands four and eight high. One rank alone on one H200 (BUILD_NOTES
# 2026-12-01, eleventh session), M = 32768: row bands 8 high take 0-12% off the D = 2 table's
# GEMM core (proxy8 Llama o_proj 882 -> 773 us) and 4-17% off column bands one wide at D = 4.
ORDER_VARIANTS = (("N", 1), ("N", 4), ("M", 8), ("M", 4))


def order_variants(base: Config, *, m: int, n: int, k_shard: int,
                   num_devices: int) -> list[Config]:
  """`base` (the incumbent: its tiles, comm path and numerics kept) first, then with each tile
  order of ORDER_VARIANTS; those the kernel cannot take for the shape left out."""
  return _fitting([base] + [
      dataclasses.replace(base, grid_minor_dim=config_lib.MatmulDimension[minor],
                          grid_tile_width=width)
      for minor, width in ORDER_VARIANTS], m=m, n=n, k_shard=k_shard, num_devices=num_devices)


def prefetch_variants(base: Config, *, m: int, n: int, k_shard: int,
                      num_devices: int) -> list[Config]:
  """`base` (the incumbent) first, then `base` with Config.prefetch_tiles switched over where
  it can run for the k_shard (Config.prefetch_runs), then with it at a pipeline one step
  deeper or shallower (not under 3) where that depth divides the k blocks and fits SMEM: most
  tuned entries have 3 steps, which divide none of D = 2's seed k_shards but Mixtral o_proj's
  (one D = 2 rank alone on one H100: 4 steps with it 0.9-2.9% faster than 3 without on 5 of
  those 12 entries, within 0.7% on 6, 3.4% slower on Llama down_proj M = 32768, where the
  table's own config moved 5.8% between two calls; BUILD_NOTES 2026-12-06). Those the kernel
  cannot take for the shape left out."""
  flipped = dataclasses.replace(base, prefetch_tiles=not base.prefetch_tiles)
  others = [flipped] if base.prefetch_runs(k_shard) else []
  for steps in (base.max_concurrent_steps + 1, base.max_concurrent_steps - 1):
    cfg = dataclasses.replace(base, max_concurrent_steps=steps, prefetch_tiles=True)
    if steps >= 3 and cfg.prefetch_runs(k_shard) and cfg.fits_smem(num_devices):
      others.append(cfg)
  return _fitting([base, *others], m=m, n=n, k_shard=k_shard, num_devices=num_devices)


def spread_variants(base: Config, *, m: int, n: int, k_shard: int,
                    num_devices: int) -> list[Config]:
  """`base` (the incumbent) first, then with Config.spread_stores switched over (on: with
  deferred signals, as it needs), fitted to SMEM; left out where the kernel cannot take it
  (pairs). On one H100 it took 1-6% off a D = 8 rank's GEMM core, but its whole tile of SMEM
  cost the owner's receive stages there (that rank's program 3-8% slower); over NVLink, where
  a push holds up the SM's next loads (docs/design.md section 7), it has not run."""
  flipped = config_lib.with_spread(base, not base.spread_stores)
  return _fitting([base, flipped], m=m, n=n, k_shard=k_shard, num_devices=num_devices)


def ag_tile_variants(m_shard: int, k: int, n: int) -> list:
  """jax's all-gather matmul configs for [m_shard, k] x [k, n] per device: its default
  (`ag_matmul.default_config`) first, then the default with each CTA tile of TILE_VARIANTS and
  64 x 128; those whose tiles do not cover the shape (`ag_matmul.tiling_problem`) left out.
  Each step of that kernel multiplies one gathered shard: at small M its default 128 x 256
  tiles give a few dozen tiles per step for 132 SMs (Llama o_proj M = 512 at D = 2: 32)."""
  from pallas_rs.kernel import ag_matmul  # pylint: disable=g-import-not-at-top
  base = ag_matmul.default_config(m_shard, n)
  out = [base] if ag_matmul.tiling_problem(base, m_shard=m_shard, k=k, n=n) is None else []
  for tile_m, tile_n, wg in (*TILE_VARIANTS, (64, 64, "N")):
    cfg = config_lib.with_tile(base, tile_m, tile_n, config_lib.MatmulDimension[wg])
    if cfg not in out and ag_matmul.tiling_problem(cfg, m_shard=m_shard, k=k, n=n) is None:
      out.append(cfg)
  return out


# Warpgroup tiles (tile_m, tile_n, wg_dimension) of search_space: the N split's 64/128 x 64/128
# and the M split's 128 x 128/192/256 and 256 x 128 CTA tiles.
_M, _N = config_lib.MatmulDimension.M, config_lib.MatmulDimension.N
_SEARCH_TILES = tuple((tm, tn, _N) for tm in (64, 128) for tn in (64, 128)) + (
    (64, 128, _M), (64, 192, _M), (64, 256, _M), (128, 128, _M))


def search_space(*, m: int, n: int, k_shard: int, num_devices: int,
                 num_sms: int = config_lib.DEFAULT_NUM_SMS) -> Iterator[Config]:
  """Every config the tuner may try for this shape: valid and within the SMEM limit.

  Comm CTAs push here; the pulling ones (faster per comm CTA, jax >= 0.11.2 on devices) are
  tried around a tuned config by comm_variants (autotune.py --candidates=comm)."""
  # Fixed per D by the error rule (default_numerics), not tuned.
  partial_dtype, owner_sum = config_lib.NUMERICS_MODES[defaults.default_numerics(num_devices)]
  tma_add = config_lib.tma_add_runs(num_devices, owner_sum)  # As default_config.
  # As default_config, like the walk: a property of the CTA tile alone.
  interleave = {(tm, tn, wg): Config(tile_m=tm, tile_n=tn, wg_dimension=wg,
                                     epi_tile_n=config_lib.epi_tile_n_for(tn, partial_dtype)
                                     ).interleave_pays(m, num_devices)
                for tm, tn, wg in _SEARCH_TILES}
  for (tile_m, tile_n, wg), steps, recv_stages, minor, width, eager, comm, out_slots, spread in (
      itertools.product(_SEARCH_TILES, (2, 3, 4, 5), (1, 2, 4),
                        (_N, _M), (1, 4, 8), (0, 1),
                        (0, 1, 2, 4, 8), (0, 8), (False, True))):
    if num_devices == 1 and (recv_stages != 1 or eager or comm or out_slots):
      continue
    if spread and num_devices > 1:  # (tried around a tuned config there: spread_variants)
      continue
    if tma_add and recv_stages != 2:  # (they allocate nothing: the same kernel)
      continue
    if not config_lib.nvlink_has_run(tile_n, wg, tma_add, num_devices):
      continue  # NVLink refuses it (fused.nvlink_unverified): nothing to measure
    cfg = config_lib.with_prefetch(Config(  # As default_config: wherever it runs.
        tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=steps,
        epi_tile_m=64, epi_tile_n=config_lib.epi_tile_n_for(tile_n, partial_dtype),
        wg_dimension=wg,
        recv_stages=recv_stages, grid_minor_dim=minor, grid_tile_width=width,
        num_sms=num_sms, eager_signal_steps=eager, comm_ctas=comm,
        out_slots=out_slots, partial_dtype=partial_dtype, owner_sum=owner_sum,
        tma_add=tma_add, interleave_steps=interleave[tile_m, tile_n, wg],
        spread_stores=spread), k_shard)
    try:
      cfg.check_shape(m=m, n=n, k_shard=k_shard, num_devices=num_devices)
    except NotImplementedError:
      continue
    yield cfg
