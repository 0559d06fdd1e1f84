"""Kernel configuration: a frozen, self-validating dataclass and what derives one config from
another (numerics, warpgroup split, SMEM fit); the default choice is defaults.py."""
from __future__ import annotations

import dataclasses
import math

from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu

from pallas_rs.kernel import schedule

MatmulDimension = hopper_matmul_mgpu.MatmulDimension

# `shared_memory_per_block_optin` on H100/H200 (measured: 232448 on one H200).
SMEM_LIMIT_BYTES = 232_448
# Barriers, semaphores and alignment slack that the estimate below does not itemise.
SMEM_SLACK_BYTES = 2_048
# SM count of an H100/H200 SXM: a fixed persistent grid lowers without a GPU (jax.export).
DEFAULT_NUM_SMS = 132
PARTIAL_DTYPES = ("bfloat16", "float32")
# Largest TMA copy of a comm CTA: 4 x 32 KB in flight reach one SM's pull rate (design 3.2).
COMM_COPY_BYTES = 32 * 1024
# How the owner adds the D partials of its chunk (Config.owner_sum; docs/design.md section 5):
# "fp32" (one rounding at the end) or "bf16_ring" (the unfused path's arithmetic and order).
OWNER_SUMS = ("fp32", "bf16_ring")
COMM_MODES = ("push", "pull", "owner")
# The numerics modes users and the tuner choose between: name -> (partial_dtype, owner_sum).
NUMERICS_MODES = {
    "fp32_partials": ("float32", "fp32"),
    "bf16_partials": ("bfloat16", "fp32"),
    "unfused_order": ("bfloat16", "bf16_ring"),
}


def wg_split_aligned(tile_n: int, wg_dimension) -> bool:
  """Whether w's SMEM block splits between the warpgroups at the 128-byte swizzle (along N at
  column tile_n, on 64-column tiles), as ag_matmul and `with_wg_along_n` keep to; Config also
  takes 32-column multiples at the 64-byte swizzle, which ran slower (BUILD_NOTES 2026-12-02)."""
  return MatmulDimension(wg_dimension) == MatmulDimension.M or tile_n % 64 == 0


def cta_tile(tile_m: int, tile_n: int, wg_dimension) -> tuple[int, int]:
  """(rows, columns) of a CTA tile: two `tile_m x tile_n` warpgroup tiles along `wg_dimension`
  (Config and jax's TuningConfig alike)."""
  if MatmulDimension(wg_dimension) == MatmulDimension.M:
    return 2 * tile_m, tile_n
  return tile_m, 2 * tile_n


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of the fused matmul + reduce-scatter kernel.

  Each of the two compute warpgroups computes a `tile_m x tile_n` tile; they sit side by side
  along `wg_dimension` (as in jax's Hopper matmul), so a CTA tile is `tile_m x 2*tile_n` (N,
  the default) or `2*tile_m x tile_n` (M).

  Attributes:
    tile_m: rows of a warpgroup tile; `m // num_devices` a multiple of `cta_tile_m`.
    tile_n: columns of a warpgroup tile; `n` must be a multiple of the CTA tile's columns.
    wg_dimension: along which dimension the two warpgroup tiles sit (MatmulDimension); M
      makes CTA tiles such as 128 x 192 (fills 128 of 132 SMs where 128 x 256 leaves 36 idle).
    tile_k: contraction block; `k_shard` must be a multiple.
    max_concurrent_steps: TMA pipeline depth (SMEM slots for x and w blocks).
    epi_tile_m: rows of an epilogue sub-tile (TMA store/load box).
    epi_tile_n: columns of an epilogue sub-tile.
    recv_stages: SMEM slots per warpgroup prefetching received partials (owner's epilogue).
    grid_minor_dim: minor dimension of the snake order of tiles within a chunk.
    grid_tile_width: width of the snake bands.
    num_sms: CTAs of the persistent grid (all ranks together in loopback mode).
    eager_signal_steps: how many of the last remote steps announce a tile once its store
      lands, not at the CTA's next epilogue (schedule.py); 0 (default) defers all.
    comm_ctas: CTAs per rank that only move partial tiles (docs/design.md section 3.2); n > 0
      (kernel v3): compute CTAs stage every peer tile locally and never touch NVLink.
    out_slots: SMEM slots per warpgroup for outgoing sub-tiles; 0 (default): min(2, sub-tiles).
    partial_dtype: dtype of the partial tiles sent to their owners (PARTIAL_DTYPES).
    comm_mode: how the partials move (COMM_MODES): with comm CTAs "push" (the source's push
      staged tiles to the owner) or "pull" (the owner's load them: jax >= 0.11.2); with
      comm_ctas = 0 "owner" (the owner's compute CTAs load the staged tiles in their epilogue:
      no comm CTA, receive buffer or remote store; 3.2), else the direct push.
    owner_sum: how the owner adds the partials (OWNER_SUMS), in NCCL's ring order: "fp32"
      (one rounding) or "bf16_ring" (bf16 partials: the unfused path's arithmetic, bit for bit
      wherever the partials equal cuBLAS's). `numerics` names the pair.
    tma_add: the peers' partials summed by TMA reduce-adds as they land, the same bits (3.5;
      tma_add_runs): "bf16_ring" in the owner's output, onto which it adds its own
      (`sum_in_output`); fp32 by pulling comm CTAs at D > 2 into one slot (`sum_slot`).
    interleave_steps: the remote steps walked tile by tile, step fastest (the own step still
      last; schedule.step_and_tile): a wave reads fewer columns of w where a step is one row.
    prefetch_tiles: the memory warpgroup loads the CTA's next tile's first blocks while the
      compute warpgroups finish this one (jax's pipeline of pipelines), not after: needs the
      k_shard's blocks a multiple of the pipeline depth (check_shape).
    spread_stores: a finished tile waits in SMEM (a slot per sub-tile) and its TMA stores
      leave one sub-tile per k block of the CTA's next tile (its last tile's at once), not all
      ahead of that tile's loads on the SM's TMA unit (docs/design.md section 3). D > 1: with
      deferred signals and no pairs (check_shape); own tiles TMA-added with tma_add at once.
    pingpong: the two warpgroup tiles of a CTA tile computed in turn through one ring of
      max_concurrent_steps SMEM slots, so one's epilogue runs under the other's mainloop
      (pingpong.py, docs/design.md 3.7); not with pairs, prefetch_tiles or spread_stores.
  """
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 3
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  recv_stages: int = 2
  grid_minor_dim: MatmulDimension = MatmulDimension.N
  grid_tile_width: int = 1
  wg_dimension: MatmulDimension = MatmulDimension.N
  num_sms: int = DEFAULT_NUM_SMS
  eager_signal_steps: int = 0
  comm_ctas: int = 0
  out_slots: int = 0
  partial_dtype: str = "bfloat16"
  owner_sum: str = "fp32"
  comm_mode: str = "push"
  tma_add: bool = False
  interleave_steps: bool = False
  prefetch_tiles: bool = False
  spread_stores: bool = False
  pingpong: bool = False

  def __post_init__(self):
    tile_m, tile_n, tile_k = self.tile_m, self.tile_n, self.tile_k
    epi_tile_m, epi_tile_n = self.epi_tile_m, self.epi_tile_n
    if tile_m not in (64, 128):
      raise ValueError(f"{tile_m=} must be 64 or 128 (one wgmma row block per warpgroup)")
    if tile_n % 8 or not 8 <= tile_n <= 256:
      raise ValueError(f"{tile_n=} must be a multiple of 8 in [8, 256] (wgmma N)")
    if tile_k % 64 or tile_k <= 0:
      raise ValueError(f"{tile_k=} must be a positive multiple of 64 (128-byte bf16 swizzle)")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
    if epi_tile_m <= 0 or tile_m % epi_tile_m:
      raise ValueError(f"{tile_m=} must be divisible by {epi_tile_m=}")
    if epi_tile_n <= 0 or tile_n % epi_tile_n:
      raise ValueError(f"{tile_n=} must be divisible by {epi_tile_n=}")
    if epi_tile_n % 8:
      raise ValueError(f"{epi_tile_n=} must be a multiple of 8 (16-byte TMA rows)")
    if self.out_slots < 0:
      raise ValueError(f"out_slots={self.out_slots} must be >= 0 (0: the default of 2)")
    for field, low in (("recv_stages", 1), ("grid_tile_width", 1), ("num_sms", 1),
                       ("eager_signal_steps", 0), ("comm_ctas", 0)):
      if getattr(self, field) < low:
        raise ValueError(f"{field}={getattr(self, field)} must be >= {low}")
    if self.partial_dtype not in PARTIAL_DTYPES:
      raise ValueError(f"partial_dtype={self.partial_dtype!r} must be one of {PARTIAL_DTYPES}")
    if self.comm_mode not in COMM_MODES:
      raise ValueError(f"comm_mode={self.comm_mode!r} must be one of {COMM_MODES}")
    if self.comm_mode == "owner" and (self.comm_ctas or self.tma_add):
      raise ValueError("comm_mode='owner' (the owner's compute CTAs load and sum the partials) "
                       f"needs comm_ctas=0, tma_add=False; got {self.comm_ctas}, {self.tma_add}")
    if self.owner_sum not in OWNER_SUMS:
      raise ValueError(f"owner_sum={self.owner_sum!r} must be one of {OWNER_SUMS}")
    if self.owner_sum == "bf16_ring" and self.partial_dtype != "bfloat16":
      raise ValueError(f"owner_sum='bf16_ring' adds bf16 partials; partial_dtype="
                       f"{self.partial_dtype!r} must be 'bfloat16'")
    for flag in BOOL_FIELDS:
      if not isinstance(getattr(self, flag), bool):
        raise ValueError(f"{flag}={getattr(self, flag)!r} must be a bool")
    if self.tma_add and self.numerics == "bf16_partials":
      raise ValueError(  # Widened by the comm CTAs it ran slower: git tag sum-slot-upcast-v1.
          "tma_add does not add bf16 partials into an fp32 sum (numerics mode 'bf16_partials'); "
          "'unfused_order' and 'fp32_partials' take it")
    object.__setattr__(self, "grid_minor_dim", MatmulDimension(self.grid_minor_dim))
    object.__setattr__(self, "wg_dimension", MatmulDimension(self.wg_dimension))

  @property
  def cta_tile_m(self) -> int:
    return cta_tile(self.tile_m, self.tile_n, self.wg_dimension)[0]

  @property
  def cta_tile_n(self) -> int:
    return cta_tile(self.tile_m, self.tile_n, self.wg_dimension)[1]

  def chunk_group(self, m: int, num_devices: int) -> int:
    """Row chunks (of m // num_devices rows) one CTA tile spans (schedule.chunk_group)."""
    return schedule.chunk_group(m // num_devices, self.tile_m,
                                self.wg_dimension == MatmulDimension.M, num_devices)

  def interleave_pays(self, m: int, num_devices: int) -> bool:
    """schedule.interleave_pays for this CTA tile over m rows at num_devices (pairs counted)."""
    return schedule.interleave_pays(m // num_devices, self.cta_tile_m, num_devices,
                                    self.chunk_group(m, num_devices))

  @property
  def sub_tiles(self) -> int:
    """Epilogue sub-tiles of a warpgroup tile."""
    return (self.tile_m * self.tile_n) // (self.epi_tile_m * self.epi_tile_n)

  @property
  def num_out_slots(self) -> int:
    if self.spread_stores:
      return self.sub_tiles
    return min(self.out_slots or 2, self.sub_tiles)

  @property
  def numerics(self) -> str:
    """The numerics mode (a key of NUMERICS_MODES) of (partial_dtype, owner_sum)."""
    return next(k for k, v in NUMERICS_MODES.items() if v == (self.partial_dtype, self.owner_sum))

  @property
  def sum_in_output(self) -> bool:
    """The peers' bf16 partials land in the owner's output (tma_add, "bf16_ring")."""
    return self.tma_add and self.owner_sum == "bf16_ring"

  @property
  def sum_slot(self) -> bool:
    """The peers' fp32 partials are TMA-added into one receive slot (tma_add, "fp32")."""
    return self.tma_add and self.owner_sum == "fp32"

  def tma_add_can_run(self, num_devices: int) -> bool:
    """tma_add_runs for this config's numerics and way of moving the partials."""
    return tma_add_runs(num_devices, self.owner_sum, self.comm_ctas, self.comm_mode,
                        self.partial_dtype)

  def receive_slots(self, num_devices: int) -> int:
    """Receive slots per rank: one per peer, one for the peers' sum (sum_slot), or none where
    the partials land in the output (sum_in_output) or wait in the sources' staging ("owner")."""
    if num_devices == 1 or self.sum_in_output or self.comm_mode == "owner":
      return 0
    return 1 if self.sum_slot else num_devices - 1

  @property
  def staged(self) -> bool:
    """Whether remote tiles go to the rank's own staging buffer (comm CTAs, or "owner")."""
    return self.comm_ctas > 0 or self.comm_mode == "owner"

  @property
  def reads_peers(self) -> bool:
    """Whether TMA loads read peers' staging buffers (pulling comm CTAs, or "owner")."""
    return self.comm_mode == "owner" or (self.comm_ctas > 0 and self.comm_mode == "pull")

  @property
  def operand_swizzle_cols(self) -> int:
    """bf16 columns of the x and w blocks' SMEM swizzle tile: 64 (128 B) where tile_n is a
    multiple of 64, else 32 (64 B): w's block splits between the warpgroups at column tile_n,
    and wgmma takes both operands with one swizzle (a 96-column tile lowers only with 64 B)."""
    return 64 if self.tile_n % 64 == 0 else 32

  def pipeline_slots(self, k_shard: int) -> int:
    """The depth jax's pipeline runs over k_shard: max_concurrent_steps, or its blocks if fewer."""
    return min(self.max_concurrent_steps, k_shard // self.tile_k)

  def prefetch_runs(self, k_shard: int) -> bool:
    """Whether prefetch_tiles can run: k_shard's blocks a multiple of the pipeline depth."""
    blocks = k_shard // self.tile_k
    return blocks > 0 and blocks % self.pipeline_slots(k_shard) == 0

  @property
  def partial_itemsize(self) -> int:
    return 4 if self.partial_dtype == "float32" else 2

  @property
  def comm_rows(self) -> int:
    """Rows of one comm copy (a row block of a warpgroup tile): at most COMM_COPY_BYTES, where
    one SM's TMA loads from a peer reach their full rate with 4 in flight (design 3.2)."""
    rows = self.tile_m
    while rows > 8 and rows * self.tile_n * self.partial_itemsize > COMM_COPY_BYTES:
      rows //= 2
    return rows

  @property
  def _comm_copy_bytes(self) -> int:
    return self.comm_rows * self.tile_n * self.partial_itemsize

  @property
  def comm_buffer_sets(self) -> int:
    """SMEM buffers per comm warpgroup (one comm copy each): as many as fit, 1 to 4."""
    fits = lambda s: 2 * s * self._comm_copy_bytes + SMEM_SLACK_BYTES <= SMEM_LIMIT_BYTES
    return next((s for s in (4, 3, 2) if fits(s)), 1)

  def smem_bytes(self, num_devices: int, itemsize: int = 2) -> int:
    """Shared memory of a compute CTA, as body._allocations allocates it (plus a fixed slack):
    a pipeline slot holds the CTA tile's x and w blocks, or (pingpong) a warpgroup tile's."""
    rows, cols = ((self.tile_m, self.tile_n) if self.pingpong
                  else (self.cta_tile_m, self.cta_tile_n))
    pipeline = (rows + cols) * self.tile_k * self.max_concurrent_steps
    epi = self.epi_tile_m * self.epi_tile_n
    total = (pipeline + 2 * self.num_out_slots * epi) * itemsize
    if num_devices > 1:
      if self.partial_itemsize != itemsize:  # Separate SMEM slots for the partials sent.
        total += 2 * self.num_out_slots * epi * self.partial_itemsize
      if not self.sum_in_output:  # The owner's receive prefetch stages.
        total += 2 * self.recv_stages * epi * self.partial_itemsize
    return total + SMEM_SLACK_BYTES

  def comm_smem_bytes(self) -> int:
    """Shared memory of a comm CTA (0 without comm CTAs)."""
    if not self.comm_ctas:
      return 0
    return 2 * self.comm_buffer_sets * self._comm_copy_bytes + SMEM_SLACK_BYTES

  def fits_smem(self, num_devices: int, limit: int = SMEM_LIMIT_BYTES) -> bool:
    return max(self.smem_bytes(num_devices), self.comm_smem_bytes() * (num_devices > 1)) <= limit

  def check_shape(self, *, m: int, n: int, k_shard: int, num_devices: int,
                  loopback: bool = False) -> None:
    """Raises NotImplementedError if the kernel cannot take this (legal) problem with this config
    (`loopback`: on the one-GPU transport, whose D ranks share the GPU's CTAs)."""
    chunk = m // num_devices
    if self.tma_add and num_devices > 1 and not self.tma_add_can_run(num_devices):
      raise NotImplementedError(  # docs/design.md 3.5
          f"tma_add in numerics {self.numerics!r} at {num_devices=} runs "
          + ("at D = 2 or " if self.owner_sum == "bf16_ring" else "only ")
          + "with pulling comm CTAs at D > 2 (their adds in ring order are deterministic), got "
          f"comm_ctas={self.comm_ctas}, comm_mode={self.comm_mode!r}")
    if self.chunk_group(m, num_devices) == 2:
      # Pairs: a warpgroup's tile (M split) or each half (N split) has its own destination (3).
      if self.comm_ctas or self.eager_signal_steps or self.comm_mode == "owner":
        raise NotImplementedError(
            f"a CTA tile over two {chunk}-row chunks (tile_m={self.tile_m}, wg_dimension="
            f"{self.wg_dimension.name}) runs only with the direct push and deferred signals, "
            f"got comm_ctas={self.comm_ctas}, comm_mode={self.comm_mode!r}, "
            f"eager_signal_steps={self.eager_signal_steps}")
    elif chunk % self.cta_tile_m:
      raise NotImplementedError(
          f"m // num_devices = {m} // {num_devices} = {chunk} is not a multiple of "
          f"the CTA tile's {self.cta_tile_m} rows (tile_m={self.tile_m}, "
          f"wg_dimension={self.wg_dimension.name})")
    if n % self.cta_tile_n:
      raise NotImplementedError(
          f"{n=} is not a multiple of the CTA tile's {self.cta_tile_n} columns "
          f"(tile_n={self.tile_n}, wg_dimension={self.wg_dimension.name})")
    if k_shard % self.tile_k:
      raise NotImplementedError(f"{k_shard=} is not a multiple of tile_k={self.tile_k}")
    blocks = k_shard // self.tile_k
    if self.prefetch_tiles and not self.prefetch_runs(k_shard):
      raise NotImplementedError(  # jax's pipeline of pipelines keeps its slots in step.
          f"prefetch_tiles needs the {blocks} k blocks of {k_shard=} (tile_k={self.tile_k}) a "
          f"multiple of max_concurrent_steps={self.max_concurrent_steps}")
    if self.spread_stores and num_devices > 1 and (
        self.chunk_group(m, num_devices) == 2 or self.eager_signal_steps):
      raise NotImplementedError(  # A tile's stores leave during the next: it cannot say now.
          "spread_stores at D > 1 runs with deferred signals and a CTA tile within one "
          f"{chunk}-row chunk, got eager_signal_steps={self.eager_signal_steps}, "
          f"tile_m={self.tile_m}, wg_dimension={self.wg_dimension.name}")
    if self.pingpong and (self.prefetch_tiles or self.spread_stores
                          or self.chunk_group(m, num_devices) == 2):
      raise NotImplementedError(  # Its ring runs on from tile to tile; pairs share stages.
          "pingpong runs without prefetch_tiles, spread_stores and pairs (a CTA tile over two "
          f"{chunk}-row chunks), got {self.prefetch_tiles}, {self.spread_stores}, {self}")
    if self.tile_n % 32:
      raise NotImplementedError(
          f"tile_n={self.tile_n} must be a multiple of 32: the x and w blocks take the 128 B "
          "or the 64 B swizzle (Config.operand_swizzle_cols: 64 or 32 columns)")
    if not self.fits_smem(num_devices):
      raise NotImplementedError(
          f"config needs {self.smem_bytes(num_devices)} B (compute CTA) and "
          f"{self.comm_smem_bytes()} B (comm CTA) of shared memory at {num_devices=}, over "
          f"the {SMEM_LIMIT_BYTES} B limit: {self}")
    # Loopback runs num_sms // D CTAs per rank; on devices each rank has num_sms.
    ctas = self.num_sms // num_devices if loopback else self.num_sms
    if num_devices > 1 and self.comm_ctas >= ctas:
      raise NotImplementedError(
          f"comm_ctas={self.comm_ctas} leaves no compute CTA among the {ctas} CTAs of a "
          + (f"loopback rank (num_sms // num_devices = {self.num_sms} // {num_devices})"
             if loopback else "rank"))


# Config's on/off switches, checked to be bools here and in tables, read off the annotations.
BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(Config) if f.type in ("bool", bool))


def tma_add_runs(num_devices: int, owner_sum: str, comm_ctas: int = 0,
                 comm_mode: str = "push", partial_dtype: str = "bfloat16") -> bool:
  """Whether the TMA add (Config.tma_add) can run, with the same bits: in the ring's numerics
  at D = 2 (2-5 us less alone at small M), and with pulling comm CTAs at D > 2, adding in ring
  order, bf16 into the output or fp32 into one slot (2-11% faster in loopback; 2026-12-01)."""
  pulled = num_devices > 2 and comm_ctas > 0 and comm_mode == "pull"
  if owner_sum == "bf16_ring":
    return comm_mode != "owner" and (num_devices == 2 or pulled)
  return pulled and partial_dtype == "float32"


def nvlink_has_run(tile_n: int, wg_dimension, tma_add: bool, num_devices: int) -> bool:
  """Whether warpgroup tiles like these have run over NVLink (fused.nvlink_unverified): any at
  D = 1 or with the TMA add; without it, tiles side by side along N of at most 128 columns."""
  return (num_devices == 1 or tma_add
          or (MatmulDimension(wg_dimension) == MatmulDimension.N and tile_n <= 128))


def with_partial_dtype(cfg: Config, partial_dtype: str, num_devices: int) -> Config:
  """`cfg` sending `partial_dtype` partials (fp32 owner sum, no tma_add): the epilogue sub-tile
  narrowed, the pipeline shortened as far as needed to fit SMEM (the caller checks the shape)."""
  cfg = dataclasses.replace(cfg, partial_dtype=partial_dtype, owner_sum="fp32", tma_add=False,
                            epi_tile_n=epi_tile_n_for(cfg.tile_n, partial_dtype))
  return fit_smem(cfg, num_devices)


def with_numerics(cfg: Config, mode: str, num_devices: int) -> Config:
  """`cfg` in numerics mode `mode` (a key of NUMERICS_MODES), fitted to SMEM as
  `with_partial_dtype` does; tma_add kept only where it runs in that mode (tma_add_runs)."""
  if mode not in NUMERICS_MODES:
    raise ValueError(f"numerics mode {mode!r} must be one of {tuple(NUMERICS_MODES)}")
  partial_dtype, owner_sum = NUMERICS_MODES[mode]
  out = dataclasses.replace(cfg, partial_dtype=partial_dtype, owner_sum=owner_sum,
                            epi_tile_n=epi_tile_n_for(cfg.tile_n, partial_dtype), tma_add=False)
  return fit_smem(dataclasses.replace(
      out, tma_add=cfg.tma_add and out.tma_add_can_run(num_devices)), num_devices)


def with_tile(cfg: Config, tile_m: int, tile_n: int, wg_dimension=None) -> Config:
  """`cfg` with warpgroup tiles of tile_m x tile_n, side by side along `wg_dimension` (default:
  cfg's), its epilogue sub-tile narrowed to divide tile_n; the caller fits SMEM and checks the
  shape. Also takes jax's `hopper_matmul_mgpu.TuningConfig` (same fields: ag_tile_variants)."""
  wg = cfg.wg_dimension if wg_dimension is None else MatmulDimension(wg_dimension)
  return dataclasses.replace(cfg, tile_m=tile_m, tile_n=tile_n, wg_dimension=wg,
                             epi_tile_n=math.gcd(cfg.epi_tile_n, tile_n))


def with_wg_along_n(cfg: Config) -> Config:
  """`cfg` with the same CTA tile split along N (what NVLink runs without the TMA add:
  fused.nvlink_unverified); NotImplementedError where half its columns are not 64-aligned."""
  if cfg.wg_dimension == MatmulDimension.N:
    return cfg
  if not wg_split_aligned(cfg.cta_tile_n // 2, MatmulDimension.N):
    raise NotImplementedError(f"a {cfg.cta_tile_m} x {cfg.cta_tile_n} CTA tile cannot split "
                              "along N (half its columns must be a multiple of 64)")
  return with_tile(cfg, cfg.cta_tile_m, cfg.cta_tile_n // 2, MatmulDimension.N)


def with_prefetch(cfg: Config, k_shard: int) -> Config:
  """`cfg` with prefetch_tiles wherever it can run over k_shard (Config.prefetch_runs), as the
  default and the search space take it, never giving up pipeline depth for it (one H100: 2-10%
  faster at 12-16 blocks, 2 steps with it 0-21% slower than 3 without: docs/design.md 3)."""
  return dataclasses.replace(cfg, prefetch_tiles=cfg.prefetch_runs(k_shard))


def with_spread(cfg: Config, on: bool) -> Config:
  """`cfg` with spread_stores `on`, and then the deferred signals it runs with (check_shape)."""
  return dataclasses.replace(cfg, spread_stores=on, **({"eager_signal_steps": 0} if on else {}))


def fit_smem(cfg: Config, num_devices: int) -> Config:
  """`cfg` with the deepest pipeline that fits SMEM (to 2 steps: it feeds the tensor cores on
  every tile), then the most receive stages that fit beside it (to 1: a D = 8 rank's owner's sum
  40% shorter with 2 than 1 at M = 2048; BUILD_NOTES 106th). The caller checks the result."""
  for steps in range(cfg.max_concurrent_steps, 1, -1):
    for recv in range(cfg.recv_stages, 0, -1):
      out = dataclasses.replace(cfg, max_concurrent_steps=steps, recv_stages=recv)
      if out.fits_smem(num_devices):
        return out
  return dataclasses.replace(cfg, max_concurrent_steps=2, recv_stages=1)


def epi_tile_n_for(tile_n: int, partial_dtype: str) -> int:
  """Epilogue sub-tile columns for `partial_dtype` partials (and the tuner's): fp32 64 x 32 take
  the SMEM of bf16 64 x 64; narrower where they would not divide tile_n (96: 32)."""
  return math.gcd(32 if partial_dtype == "float32" else 64, tile_n)
