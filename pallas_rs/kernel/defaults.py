"""The default config of a problem: the numerics mode by D and the CTA tile by a wave model
(a heuristic, not tuned; the tuning table overrides it, pallas_rs/tuning)."""
from __future__ import annotations

import dataclasses

from pallas_rs.kernel import schedule
from pallas_rs.kernel.config import Config
from pallas_rs.kernel.config import DEFAULT_NUM_SMS
from pallas_rs.kernel.config import MatmulDimension
from pallas_rs.kernel.config import NUMERICS_MODES
from pallas_rs.kernel.config import cta_tile
from pallas_rs.kernel.config import epi_tile_n_for
from pallas_rs.kernel.config import nvlink_has_run
from pallas_rs.kernel.config import tma_add_runs
from pallas_rs.kernel.config import with_prefetch


def default_numerics(num_devices: int) -> str:
  """The numerics mode (NUMERICS_MODES) that keeps the seed's error rule at this D, at the
  fewest bytes (docs/design.md section 5.2): "unfused_order" at D = 2 (the unfused path's own
  arithmetic), "fp32_partials" at D = 3-4 (a guarantee; bf16 partials broke the rule at D = 4
  and NCCL's order there is unchecked), "bf16_partials" at D = 8 (a wide measured margin)."""
  if num_devices == 2:
    return "unfused_order"
  return "fp32_partials" if num_devices <= 4 else "bf16_partials"


def _largest_steps(base: Config, num_devices: int, upper: int = 6) -> Config:
  for steps in range(upper, 1, -1):
    cfg = dataclasses.replace(base, max_concurrent_steps=steps)
    if cfg.fits_smem(num_devices):
      return cfg
  return dataclasses.replace(base, max_concurrent_steps=2)


# Default CTA tiles: (tile_m, tile_n, wg_dimension) -> time per unit of tile area relative to
# the best, measured on one H200 over the 16 small-M per-GPU GEMMs of the seed
# (experiments/gemm_core.py, BUILD_NOTES 2026-12-01): warpgroups stacked along M (64 x 256 each)
# beat the same 128 x 256 CTA tile split along N by 0-2.5% on 13 of 16; 128 x 192 tiles cost
# ~2% more per area but fill the SMs where 128 x 256 ones leave them idle (Mixtral M = 512: 96
# tiles on 132 SMs; 0.79-0.90x XLA's dot instead of 0.98-1.08x); 128 x 128 and 64 x 256 CTA
# tiles cost ~9-10% more, 64 x 128 ones 46-65% more (the M split's 128 x 128 and 128 x 64: guessed).
_DEFAULT_TILES = {(64, 256, MatmulDimension.M): 1.0, (64, 192, MatmulDimension.M): 1.02,
                  (128, 128, MatmulDimension.N): 1.01, (128, 64, MatmulDimension.N): 1.09,
                  (64, 128, MatmulDimension.M): 1.09, (64, 128, MatmulDimension.N): 1.1,
                  (64, 64, MatmulDimension.N): 1.55, (64, 64, MatmulDimension.M): 1.6}


def _default_tiles(chunk: int, n: int, num_devices: int, num_sms: int, tma_add: bool):
  """The CTA tile of least modelled time: waves (the D chunks' tiles over num_sms CTAs, rounded
  up) x tile area x its relative cost (_DEFAULT_TILES); ties go to the earlier tile. A 128-row
  tile over a pair of 64-row chunks (schedule.chunk_group) counts as one tile of the pair.
  Only tiles NVLink has run with or without `tma_add` (nvlink_has_run)."""
  best = None
  for (tile_m, tile_n, wg), slowdown in _DEFAULT_TILES.items():
    if not nvlink_has_run(tile_n, wg, tma_add, num_devices):
      continue
    cta_m, cta_n = cta_tile(tile_m, tile_n, wg)
    group = schedule.chunk_group(chunk, tile_m, wg == MatmulDimension.M, num_devices)
    if group * chunk % cta_m or n % cta_n:
      continue
    tiles = schedule.total_tiles(chunk, n, cta_m, cta_n, num_devices, group)
    cost = -(-tiles // num_sms) * cta_m * cta_n * slowdown
    if best is None or cost < best[0]:
      best = (cost, (tile_m, tile_n, wg))
  return best[1] if best else None


# Tile orders within a step (grid_minor_dim, grid_tile_width): bands one column of tiles wide,
# walked down the chunk's rows (the default), or bands 8 rows of tiles high, walked along n.
_COLUMN_BANDS, _ROW_BANDS = (MatmulDimension.N, 1), (MatmulDimension.M, 8)


def _tile_order(grid: tuple[int, int], cta_m: int, cta_n: int, num_sms: int):
  """Row bands where a wave of them reads less (schedule.wave_footprint), else column bands.
  Measured one rank alone on one H200 (BUILD_NOTES 2026-12-01, eleventh session): row bands
  are 4-17% faster at D = 4, M = 32768 (chunks of 64 rows of 128 x 256 tiles) and, over whole
  GEMMs of 48, 64 and 128 such rows, 0.6-6.4%, 1-8% and 4-12% faster; at 32 rows or fewer,
  where the model sees no difference, the two orders cost within 2% (column bands 0-1.7%
  ahead where the difference held across iterations)."""
  columns = schedule.wave_footprint(grid, cta_m, cta_n, *_COLUMN_BANDS, num_sms)
  rows = schedule.wave_footprint(grid, cta_m, cta_n, *_ROW_BANDS, num_sms)
  return _ROW_BANDS if rows < columns else _COLUMN_BANDS


def default_config(*, m: int, n: int, k_shard: int, num_devices: int,
                   num_sms: int = DEFAULT_NUM_SMS) -> Config:
  """A valid config for every shape the kernel supports (heuristic, not tuned).

  Raises NotImplementedError if no tiling fits the shape.
  """
  chunk = m // num_devices
  where = f"(per-device problem m={m}, n={n}, k_shard={k_shard}, {num_devices=})"
  if chunk < 64:
    raise NotImplementedError(
        f"m // num_devices = {m} // {num_devices} = {chunk} rows is below the smallest tile "
        f"(64); no padding {where}")
  if chunk % 64:
    raise NotImplementedError(
        f"m // num_devices = {chunk} is not a multiple of 64 (tile_m); no padding {where}")
  if n % 64:
    raise NotImplementedError(
        f"{n=} is not a multiple of 64 (the narrowest CTA tile); no padding {where}")
  tile_k = 64
  if k_shard % tile_k:
    raise NotImplementedError(f"{k_shard=} is not a multiple of 64 (tile_k); no padding {where}")
  partial_dtype, owner_sum = NUMERICS_MODES[default_numerics(num_devices)]
  tma_add = tma_add_runs(num_devices, owner_sum)
  # The M split only with the TMA add (or at D = 1): without it, it has not completed over
  # NVLink (nvlink_has_run); alone, the N split of the same CTA tile costs 0-5% (seventh
  # session), Mixtral M = 512 at D = 4 (no 128 x 192) 15-22% (BUILD_NOTES 2026-12-01).
  tiles = _default_tiles(chunk, n, num_devices, num_sms, tma_add)
  if tiles is None:
    m_split = nvlink_has_run(64, MatmulDimension.M, tma_add, num_devices)
    raise NotImplementedError(
        f"{n=} is not a multiple of 128, which the warpgroups side by side along N need, "
        + (f"and m // num_devices = {chunk} not of 128 (a 64-row tile needs 128 columns)"
           if m_split else "and the M split runs only with the TMA add")
        + f": no CTA tile fits; no padding {where}")
  tile_m, tile_n, wg = tiles
  cfg = Config(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, epi_tile_m=64,
               epi_tile_n=epi_tile_n_for(tile_n, partial_dtype), wg_dimension=wg, num_sms=num_sms,
               partial_dtype=partial_dtype, owner_sum=owner_sum)
  cfg = with_prefetch(_largest_steps(cfg, num_devices), k_shard)
  grid = schedule.tile_grid(chunk, n, cfg.cta_tile_m, cfg.cta_tile_n,
                            cfg.chunk_group(m, num_devices))
  minor, width = _tile_order(grid, cfg.cta_tile_m, cfg.cta_tile_n, num_sms)
  cfg = dataclasses.replace(  # steps as measured
      cfg, tma_add=tma_add, grid_minor_dim=minor, grid_tile_width=width,
      interleave_steps=cfg.interleave_pays(m, num_devices))
  cfg.check_shape(m=m, n=n, k_shard=k_shard, num_devices=num_devices)
  return cfg
