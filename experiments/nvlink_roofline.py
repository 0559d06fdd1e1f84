r"""NVLink primitives as Mosaic GPU kernels, against a CUDA microbenchmark on the same machines.

  NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_ALLOCATOR=default PYTHONPATH=. \
      python experiments/nvlink_roofline.py --out=/tmp/mg/nvlink_roofline.json
  python experiments/nvlink_roofline.py --lower_only      # any machine: lower every variant

Every kernel runs inside jax.shard_map over a 1-D mesh of `--num_devices` GPUs (default 2), all
devices running it at once, as a reduce-scatter would (`--directions=one`: only rank 0 moves
data, the CUDA figures' setting). Per CTA (grid=(ctas,), one warpgroup):

  push   TMA stores SMEM -> the peer (rank + 1) % D's output buffer, `inflight` stores
         outstanding (wait_smem_to_gmem(inflight - 1, wait_read_only=True) before reusing a
         slot), wait_smem_to_gmem(0) at the end.
  pull   TMA loads the peer (rank + 1) % D's *input* buffer -> a ring of `inflight` SMEM slots
         and barriers. Inputs outlive the kernel, so no exit handshake is needed
         (`--pull_handshake` adds one: signal the source, wait for the readers).
  local  the push loop with a local destination (HBM write bandwidth, for scale).
  hol    head-of-line probe: one TMA store (to the peer, local HBM or none; all, half or one of
         the CTAs), then a 32 KB TMA load of local memory, timed in the kernel with
         %globaltimer (ns) and %clock (SM cycles) around the load's barrier wait.

Chunks: `--layouts=flat` (default) moves 1-D contiguous chunks (`--chunk_kb`, 32): Mosaic emits
plain `cp.async.bulk` (no tensor map; the peer address is resolved on the device), the CUDA
benchmark's instruction. `tiled` moves [chunk / 256 B, 128] bf16 tiles with the (8, 64) tiling
and 128 B swizzle of the fused kernel's epilogue: `cp.async.bulk.tensor` through a host-built
descriptor.

Lowering semantics: push, local and hol use Warpgroup (the project's). pull runs in Lane and,
where Mosaic can lower it, Warpgroup semantics (`--pull_semantics`): jax 0.10.2 refuses a peer
GMEM ref as a TMA load source under Warpgroup lowering ("GMEM refs with peer ids are not
supported in warpgroup lowering"); jax commit 15524cbd (2026-08-05, after 0.11.1's branch
point) passes it on, with a jaxlib >= 0.11.1. Each run lowers a probe first and records the
answer under `findings.pull_warpgroup_semantics`; Warpgroup pulls are dropped where it fails.

Output: JSON (environment, per case the raw kernel times in us, max over devices, median,
GB/s per GPU and per SM, the CUDA reference and the ratio), a PNG next to it, a table last.
GB/s = bytes one GPU moves / kernel time; the kernel time excludes XLA's pre-launch barrier
kernel (its per-iteration step time including it is kept as `step_times_us`).
"""
# No `from __future__ import annotations`: the tests load this file as an unregistered module,
# where dataclasses cannot resolve string annotations.
from collections.abc import Callable, Sequence
import dataclasses
import functools
import os
from pathlib import Path
import sys
import time
from typing import Any

import bench_env  # experiments/ is sys.path[0] when run as a script.

from absl import app
from absl import flags
# Importing jax starts no backend: --lower_only can still force CPU devices in main().
import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.experimental.mosaic.gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from pallas_rs.tuning import metrics
from pallas_rs.bench import cupti
from pallas_rs.bench import timing

_OUT = flags.DEFINE_string("out", "", "JSON path (the PNG goes next to it); default "
                           "experiments/out/nvlink_roofline.json (git-ignored).")
_MECHANISMS = flags.DEFINE_list("mechanisms", ["push", "pull", "local", "hol"],
                                "Subset of push, pull, local, hol.")
_CTAS = flags.DEFINE_list("ctas", ["1", "2", "4", "8", "16", "132"],
                          "CTA counts (one CTA per SM); counts above the GPU's SMs are skipped.")
_INFLIGHT = flags.DEFINE_list("inflight", ["1", "2", "4"], "TMA copies outstanding per CTA.")
_LAYOUTS = flags.DEFINE_list("layouts", ["flat"], "flat (1-D bulk copies) and/or tiled "
                             "(swizzled 2-D tiles through a tensor map).")
_BYTES_PER_CTA_KB = flags.DEFINE_integer("bytes_per_cta_kb", 4096, "KiB moved by each CTA.")
_CHUNK_KB = flags.DEFINE_integer("chunk_kb", 32, "KiB per TMA copy.")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 2, "D: GPUs in the mesh (the first D).")
_DIRECTIONS = flags.DEFINE_enum("directions", "both", ["both", "one"],
                                "both: every rank moves data at once; one: only rank 0 does.")
_PULL_SEMANTICS = flags.DEFINE_list(
    "pull_semantics", ["lane", "warpgroup"], "Lowering semantics of the pull kernels; "
    "warpgroup is dropped (and said so) where Mosaic cannot lower a remote TMA load in it.")
_PULL_HANDSHAKE = flags.DEFINE_boolean(
    "pull_handshake", False, "Pull: each CTA signals its source after its last load and waits "
    "for its readers' CTAs before exiting (needed when pulling from a kernel output).")
_HOL_CASES = flags.DEFINE_list("hol_cases", ["none", "local_all", "peer_one", "peer_half",
                                             "peer_all", "peer_all_16k"],
                               "Head-of-line probe cases (HOL_CASES).")
_HOL_CTAS = flags.DEFINE_integer("hol_ctas", 0, "CTAs of the probe; 0: all SMs.")
_HOL_LOAD_KB = flags.DEFINE_integer("hol_load_kb", 32, "KiB of the timed local TMA load.")
_ITERATIONS = flags.DEFINE_integer("iterations", 20, "Timed iterations per case (medians).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls after compiling.")
_TIMER = flags.DEFINE_enum("timer", "auto", ["auto", "cupti", "host_wall_clock"],
                           "pallas_rs.bench.timing timer.")
_CHECK = flags.DEFINE_boolean("check", True, "First check the data each mechanism moves "
                              "(small sizes, SMEM filled from the input).")
_LOWER_ONLY = flags.DEFINE_boolean("lower_only", False, "Only lower every variant for CUDA "
                                   "(jax.export) on forced CPU devices; no GPU needed.")
_TIME_BUDGET_S = flags.DEFINE_float("time_budget_s", 420.0, "Skip the remaining cases (recorded "
                                    "as skipped) once this much wall time has passed.")

_ALL_FLAGS = (_OUT, _MECHANISMS, _CTAS, _INFLIGHT, _LAYOUTS, _BYTES_PER_CTA_KB, _CHUNK_KB,
              _NUM_DEVICES, _DIRECTIONS, _PULL_SEMANTICS, _PULL_HANDSHAKE, _HOL_CASES,
              _HOL_CTAS, _HOL_LOAD_KB, _ITERATIONS, _WARMUP, _TIMER, _CHECK, _LOWER_ONLY,
              _TIME_BUDGET_S)

AXIS = "x"
DTYPE = jnp.bfloat16
ITEMSIZE = 2
TILE_COLS = 128  # tiled layout: rows of 128 bf16 = 256 B, swizzled 128 B
DEFAULT_NUM_SMS = 132  # H200; used when lowering without a GPU
SMEM_LIMIT = 232448  # H200 shared_memory_per_block_optin (docs/mosaic-gpu-notes.md 4)
MECHANISMS = ("push", "pull", "local", "hol")
LAYOUTS = ("flat", "tiled")
KERNEL_PREFIX = "nvlink_roofline_"

# CUDA microbenchmark, nvidia-h200-x2, 2026-11-30 (the project's shared design notes, "NVLink
# primitives per SM, measured"; not in this repository): GB/s one GPU moves, 4 MB per CTA, one
# CTA per SM, 1-D `cp.async.bulk` copies of 32 KB; a pair is the measured range. push/local: one
# GPU at a time, 1-4 stores in flight (the rate did not depend on it); pull: 4 x 32 KB loads in
# flight; push_both: both GPUs pushing at once, GB/s each way.
REFERENCE_SOURCE = ("CUDA microbenchmark, nvidia-h200-x2, 2026-11-30 (shared design notes: "
                    "'NVLink primitives per SM, measured')")
REFERENCE_GBPS: dict[str, dict[int, float | tuple[float, float]]] = {
    "push": {1: 45, 4: 180, 8: (316, 321), 16: (339, 341), 132: (368, 370)},
    "pull": {1: 94, 4: 300, 8: 338, 16: 357, 132: 370},
    "local": {1: 55, 4: 222, 8: 443, 16: 886, 132: 3990},
    "push_both": {8: 284, 16: 327, 32: 340, 66: 357, 132: 364},
}
# Head-of-line probe (same source): when the 32 KB local TMA load is done (us, median of 132 SMs).
REFERENCE_HOL_US = {"none": 0.64, "local_all": 2.5, "peer_one": 1.7, "peer_half": 10.5,
                    "peer_all": 22.0, "peer_all_16k": 5.0}
# case -> (store target or None, which CTAs store: "all" | "half" | "one", store KiB)
HOL_CASES = {
    "none": (None, "all", 0),
    "local_all": ("local", "all", 64),
    "peer_one": ("peer", "one", 64),
    "peer_half": ("peer", "half", 64),
    "peer_all": ("peer", "all", 64),
    "peer_all_16k": ("peer", "all", 16),
}


# ---------------------------------------------------------------------------
# Variants.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
  """One kernel configuration (one compiled kernel).

  Attributes:
    mechanism: push, pull, local or hol.
    ctas: grid size (CTAs per device).
    inflight: TMA copies outstanding per CTA (push, pull, local).
    layout: flat (1-D chunks) or tiled ([rows, 128] swizzled tiles).
    bytes_per_cta: bytes each CTA moves (push, pull, local).
    chunk_bytes: bytes per TMA copy.
    one_way: only rank 0 moves data (the others launch the same kernel and exit).
    handshake: pull: exit handshake with the source and the readers.
    check: fill SMEM from the input (push, local) / write pulled chunks out (pull), so the
      moved data can be compared with the input; slower, never timed.
    hol_case: key of HOL_CASES (hol only).
    hol_load_bytes: the timed local load (hol only).
    semantics: "warpgroup" or "lane"; None picks the mechanism's default (pull: lane, else
      warpgroup), and only a non-default choice shows in the name.
  """
  mechanism: str
  ctas: int
  inflight: int = 1
  layout: str = "flat"
  bytes_per_cta: int = 4 << 20
  chunk_bytes: int = 32 << 10
  one_way: bool = False
  handshake: bool = False
  check: bool = False
  hol_case: str | None = None
  hol_load_bytes: int = 32 << 10
  semantics: str | None = None

  def __post_init__(self):
    if self.mechanism not in MECHANISMS:
      raise ValueError(f"mechanism={self.mechanism!r} not in {MECHANISMS}")
    if self.layout not in LAYOUTS:
      raise ValueError(f"layout={self.layout!r} not in {LAYOUTS}")
    if self.ctas < 1 or self.inflight < 1:
      raise ValueError(f"ctas={self.ctas} and inflight={self.inflight} must be >= 1")
    if self.chunk_bytes % 16 or self.bytes_per_cta % self.chunk_bytes:
      raise ValueError(f"chunk_bytes={self.chunk_bytes} must be a multiple of 16 dividing "
                       f"bytes_per_cta={self.bytes_per_cta}")
    if self.layout == "tiled":
      rows = self.chunk_elems // TILE_COLS
      if self.chunk_elems % TILE_COLS or rows % 8 or rows > 256:  # TMA box <= 256 per dim
        raise ValueError(f"tiled chunks are [rows, {TILE_COLS}] bf16 with rows a multiple of 8 "
                         f"<= 256; chunk_bytes={self.chunk_bytes} gives {rows}")
      if self.mechanism == "hol":
        raise ValueError("the head-of-line probe uses the flat layout")
    if self.mechanism == "hol":
      if self.hol_case not in HOL_CASES:
        raise ValueError(f"hol_case={self.hol_case!r} not in {sorted(HOL_CASES)}")
    elif self.hol_case is not None:
      raise ValueError("hol_case is for mechanism='hol'")
    if self.handshake and self.mechanism != "pull":
      raise ValueError("handshake is for mechanism='pull'")
    if self.semantics not in (None, "warpgroup", "lane"):
      raise ValueError(f"semantics={self.semantics!r}")
    if self.smem_bytes > SMEM_LIMIT:
      raise ValueError(f"{self.name}: {self.smem_bytes} B of SMEM exceeds {SMEM_LIMIT}")

  @property
  def chunk_elems(self) -> int:
    return self.chunk_bytes // ITEMSIZE

  @property
  def chunks_per_cta(self) -> int:
    return self.bytes_per_cta // self.chunk_bytes

  @property
  def lowering_semantics(self) -> str:
    return self.semantics or ("lane" if self.mechanism == "pull" else "warpgroup")

  @property
  def hol_store_bytes(self) -> int:
    return HOL_CASES[self.hol_case][2] << 10 if self.mechanism == "hol" else 0

  @property
  def hol_store_ctas(self) -> int:
    """How many CTAs (indices 0 .. n-1) issue the store before the timed load."""
    target, which, _ = HOL_CASES[self.hol_case]
    if target is None:
      return 0
    return {"all": self.ctas, "half": self.ctas // 2, "one": 1}[which]

  @property
  def smem_bytes(self) -> int:
    if self.mechanism == "hol":
      return self.hol_store_bytes + self.hol_load_bytes
    return self.inflight * self.chunk_bytes

  @property
  def src_elems(self) -> int:
    """Input elements per device the kernel reads (it gets at least that many)."""
    if self.mechanism == "pull":
      return self.ctas * self.bytes_per_cta // ITEMSIZE
    if self.mechanism == "hol":
      return self.ctas * self.hol_load_bytes // ITEMSIZE
    return self.ctas * self.inflight * self.chunk_elems if self.check else 0

  @property
  def bytes_moved(self) -> int:
    """Bytes one (active) GPU moves per call (hol: 0, it is a latency probe)."""
    return 0 if self.mechanism == "hol" else self.ctas * self.bytes_per_cta

  @property
  def name(self) -> str:
    if self.mechanism == "hol":
      base = f"hol_{self.hol_case}_c{self.ctas}"
    else:
      base = f"{self.mechanism}_{self.layout}_c{self.ctas}_i{self.inflight}"
    if self.semantics:
      base += f"_{self.semantics}"
    for flag, tag in ((self.one_way, "oneway"), (self.handshake, "hs"), (self.check, "check")):
      if flag:
        base += f"_{tag}"
    return base

  @property
  def kernel_name(self) -> str:
    return KERNEL_PREFIX + self.name


def _semantics(mechanism: str, pull_semantics: Sequence[str]) -> list[str | None]:
  """The `Variant.semantics` values to build for `mechanism` (None: its default)."""
  if mechanism != "pull":
    return [None]
  return [None if s == "lane" else s for s in pull_semantics]


def bandwidth_variants(mechanisms: Sequence[str], ctas: Sequence[int],
                       inflight: Sequence[int], layouts: Sequence[str], *,
                       pull_semantics: Sequence[str] = ("lane",), **common) -> list[Variant]:
  """Every (mechanism, semantics, layout, inflight, ctas) of push, pull and local."""
  return [Variant(m, c, inflight=i, layout=lay, semantics=sem, **common)
          for m in mechanisms if m != "hol" for sem in _semantics(m, pull_semantics)
          for lay in layouts for i in inflight for c in ctas]


def hol_variants(cases: Sequence[str], ctas: int, *, load_bytes: int,
                 one_way: bool) -> list[Variant]:
  return [Variant("hol", ctas, hol_case=case, hol_load_bytes=load_bytes, one_way=one_way)
          for case in cases]


def check_variants(mechanisms: Sequence[str], layouts: Sequence[str], *, chunk_bytes: int,
                   one_way: bool, handshake: bool,
                   pull_semantics: Sequence[str] = ("lane",)) -> list[Variant]:
  """Small data-checked variants: 2 CTAs x 4 chunks, 2 in flight (ring reuse included)."""
  return [Variant(m, 2, inflight=2, layout=lay, bytes_per_cta=4 * chunk_bytes,
                  chunk_bytes=chunk_bytes, one_way=one_way, check=True,
                  handshake=handshake and m == "pull", semantics=sem)
          for m in mechanisms if m != "hol" for sem in _semantics(m, pull_semantics)
          for lay in layouts]


# ---------------------------------------------------------------------------
# Kernels. Per device: src [src_elems] bf16 (flat) or [src_elems / 128, 128] (tiled).
# ---------------------------------------------------------------------------


def _compiler_params(v: Variant):
  # Lane is the default in jax 0.10.x, Warpgroup in 0.11.x: always say which.
  sem = (plgpu.LoweringSemantics.Lane if v.lowering_semantics == "lane"
         else plgpu.LoweringSemantics.Warpgroup)
  return plgpu.CompilerParams(lowering_semantics=sem)


def _peer(num_devices: int, axis: str):
  # A static offset on axis_index: tiled TMA rebuilds this arithmetic on the host.
  return lax.rem(lax.axis_index(axis) + 1, num_devices)


def _active(v: Variant, rank):
  """Whether `rank` moves data (a Python True unless one_way)."""
  return rank == 0 if v.one_way else True


def _when(cond, fn):
  """fn() under pl.when(cond), or directly when cond is the Python constant True."""
  if cond is True:
    fn()
  else:
    pl.when(cond)(fn)


def _chunk(ref, index, v: Variant):
  """Chunk `index` (of the whole buffer) of a flat or tiled GMEM ref."""
  if v.layout == "flat":
    return ref.at[pl.ds(index * v.chunk_elems, v.chunk_elems)]
  rows = v.chunk_elems // TILE_COLS
  return ref.at[pl.ds(index * rows, rows), :]


def _ring(v: Variant):
  """The SMEM ring: [inflight, chunk] (flat) or [inflight, rows, 128] swizzled (tiled)."""
  if v.layout == "flat":
    return plgpu.SMEM((v.inflight, v.chunk_elems), DTYPE)
  swizzle = 128
  return plgpu.SMEM((v.inflight, v.chunk_elems // TILE_COLS, TILE_COLS), DTYPE,
                    transforms=(plgpu.TilingTransform((8, swizzle // ITEMSIZE)),
                                plgpu.SwizzleTransform(swizzle)))


def _load(src, dst_smem, barrier):
  # PROMISE_IN_BOUNDS: ZEROS (the default) forces a tensor-map copy, which allows <= 256
  # elements per dimension; in-bounds flat chunks become one `cp.async.bulk`.
  plgpu.copy_gmem_to_smem(src, dst_smem, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)


def store_body(src, dst, ring, *barriers, v: Variant, num_devices: int, axis: str):
  """push / local: CTA c stores chunks c * n .. c * n + n - 1 of dst (the peer's or its own).

  dst [ctas * bytes_per_cta / 2] (flat) or [.. / 128, 128] (tiled), a kernel output (peers can
  only address kernel arguments); ring [inflight, chunk] SMEM. With v.check, slot s is first
  loaded from src chunk c * inflight + s, so dst chunk c * n + j holds that of slot j % inflight.
  """
  cta = lax.axis_index("cta")
  rank = lax.axis_index(axis)
  n = v.chunks_per_cta
  target = plgpu.remote_ref(dst, _peer(num_devices, axis)) if v.mechanism == "push" else dst

  def run():
    if v.check:
      (bar,) = barriers
      for s in range(v.inflight):
        _load(_chunk(src, cta * v.inflight + s, v), ring.at[s], bar.at[s])
      for s in range(v.inflight):
        plgpu.barrier_wait(bar.at[s])

    def body(j, carry):
      # At most inflight - 1 older stores may still read SMEM: store j - inflight, which used
      # this slot, has finished reading it.
      plgpu.wait_smem_to_gmem(v.inflight - 1, wait_read_only=True)
      plgpu.copy_smem_to_gmem(ring.at[lax.rem(j, v.inflight)], _chunk(target, cta * n + j, v))
      return carry

    lax.fori_loop(0, n, body, None)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # Landed, not just read.

  _when(_active(v, rank), run)


def pull_body(src, out, ring, bar, *, v: Variant, num_devices: int, axis: str):
  """pull: CTA c TMA-loads chunks c * n .. c * n + n - 1 of the peer (rank + 1)'s src.

  src: this device's input (peers read it; inputs outlive the kernel). out: [ctas] int32 done
  markers (an output keeps the kernel alive), or with v.check the pulled chunks, same layout as
  src. ring [inflight, chunk] SMEM, bar: inflight barriers, one per slot.
  """
  cta = lax.axis_index("cta")
  rank = lax.axis_index(axis)
  n = v.chunks_per_cta
  source = plgpu.remote_ref(src, _peer(num_devices, axis))

  def load(j):
    s = lax.rem(j, v.inflight)
    _load(_chunk(source, cta * n + j, v), ring.at[s], bar.at[s])

  def run():
    for i in range(min(v.inflight, n)):
      load(i)

    def body(j, carry):
      s = lax.rem(j, v.inflight)
      plgpu.barrier_wait(bar.at[s])
      if v.check:
        plgpu.copy_smem_to_gmem(ring.at[s], _chunk(out, cta * n + j, v))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # before the slot is reloaded

      @pl.when(j + v.inflight < n)
      def _():
        load(j + v.inflight)
      return carry

    lax.fori_loop(0, n, body, None)
    if v.check:
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  _when(_active(v, rank), run)
  if v.handshake:
    # My source is rank + 1; my readers are rank - 1's CTAs. Without this a rank could exit
    # (and XLA reuse its buffer) while its reader still loads from it.
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))
    _when(_active(v, rank),
          lambda: pl.semaphore_signal(sem.at[0], 1, device_id=_peer(num_devices, axis)))
    reader = lax.rem(rank + num_devices - 1, num_devices)
    _when(_active(v, reader),
          lambda: pl.semaphore_wait(sem.at[0], v.ctas, decrement=False))
  if not v.check:
    out[cta] = cta


def _now():
  """(%globaltimer_lo in ns, %clock in SM cycles), both int32 (differences wrap correctly)."""

  @plgpu.inline_mgpu(return_type=(
      plgpu.ShapeDtypeStruct((), jnp.int32, layout=plgpu.Layout.WG_SPLAT),
      plgpu.ShapeDtypeStruct((), jnp.int32, layout=plgpu.Layout.WG_SPLAT)))
  def read(ctx):
    del ctx
    return (mgpu.FragmentedArray.splat(mgpu_utils.globaltimer("low"), (), is_signed=True),
            mgpu.FragmentedArray.splat(mgpu_utils.clock(), (), is_signed=True))

  return read()


def hol_body(src, lat, dst, *scratch, v: Variant, num_devices: int, axis: str):
  """hol: CTAs 0 .. hol_store_ctas - 1 issue one TMA store of hol_store_bytes (to the peer's or
  the local dst), then every CTA times a hol_load_bytes TMA load of its own part of src.

  lat [ctas, 2] int32: (ns by %globaltimer, SM cycles by %clock) from before the load is issued
  to after its barrier wait. dst [ctas * store_elems] bf16 (output; the store's destination).
  """
  cta = lax.axis_index("cta")
  rank = lax.axis_index(axis)
  target_kind = HOL_CASES[v.hol_case][0]
  if target_kind is None:
    lbuf, bar = scratch
  else:
    sbuf, lbuf, bar = scratch
    store_elems = v.hol_store_bytes // ITEMSIZE
    target = plgpu.remote_ref(dst, _peer(num_devices, axis)) if target_kind == "peer" else dst
    conds = [rank == 0] if v.one_way else []
    if v.hol_store_ctas < v.ctas:
      conds.append(cta < v.hol_store_ctas)
    stores = functools.reduce(lambda a, b: a & b, conds) if conds else True
    _when(stores, lambda: plgpu.copy_smem_to_gmem(
        sbuf, target.at[pl.ds(cta * store_elems, store_elems)]))
  load_elems = v.hol_load_bytes // ITEMSIZE
  t0, c0 = _now()
  _load(src.at[pl.ds(cta * load_elems, load_elems)], lbuf, bar)
  plgpu.barrier_wait(bar)
  t1, c1 = _now()
  lat[cta, 0] = t1 - t0
  lat[cta, 1] = c1 - c0
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def out_types(v: Variant) -> tuple[jax.ShapeDtypeStruct, ...]:
  """Kernel outputs per device (before flattening)."""
  if v.mechanism == "hol":
    store_elems = max(v.hol_store_bytes // ITEMSIZE, 8)
    return (jax.ShapeDtypeStruct((v.ctas, 2), jnp.int32),
            jax.ShapeDtypeStruct((v.ctas * store_elems,), DTYPE))
  if v.mechanism == "pull" and not v.check:
    return (jax.ShapeDtypeStruct((v.ctas,), jnp.int32),)
  elems = v.ctas * v.bytes_per_cta // ITEMSIZE
  shape = (elems,) if v.layout == "flat" else (elems // TILE_COLS, TILE_COLS)
  return (jax.ShapeDtypeStruct(shape, DTYPE),)


def scratch_types(v: Variant) -> list:
  if v.mechanism == "hol":
    smem = [plgpu.SMEM((v.hol_store_bytes // ITEMSIZE,), DTYPE)] if v.hol_store_bytes else []
    return smem + [plgpu.SMEM((v.hol_load_bytes // ITEMSIZE,), DTYPE), plgpu.Barrier()]
  if v.mechanism == "pull" or v.check:
    return [_ring(v), plgpu.Barrier(num_barriers=v.inflight)]
  return [_ring(v)]


BODIES = {"push": store_body, "local": store_body, "pull": pull_body, "hol": hol_body}


def kernel_fn(v: Variant, num_devices: int, axis: str = AXIS) -> Callable[..., tuple]:
  """The Mosaic GPU kernel of `v`, per device: src [n_src] bf16 (n_src >= v.src_elems, a
  multiple of 128) -> its outputs (`out_types`), flattened to 1-D except hol's lat [ctas, 2]."""
  kernel = plgpu.kernel(
      functools.partial(BODIES[v.mechanism], v=v, num_devices=num_devices, axis=axis),
      out_type=out_types(v),
      scratch_types=scratch_types(v),
      grid=(v.ctas,),
      grid_names=("cta",),
      compiler_params=_compiler_params(v),
      kernel_name=v.kernel_name,
  )

  def f(src):
    if v.layout == "tiled":
      src = src.reshape(-1, TILE_COLS)
    outs = kernel(src)
    # Flat outputs stack over devices along dim 0 (hol's lat [ctas, 2] does as it is).
    return tuple(o if o.ndim == 1 or o.dtype == jnp.int32 else o.reshape(-1) for o in outs)

  return f


_MOSAIC_KERNEL_FN = kernel_fn  # `kernel_fn` itself is replaced by stand-ins in CPU tests.


def sharded_fn(v: Variant, mesh, axis: str = AXIS, build: Callable[..., Any] | None = None):
  """jit(shard_map) of `build` (default `kernel_fn`) over `mesh`: src [D * n_src] -> the
  outputs stacked over D."""
  nouts = len(out_types(v))
  f = (build or kernel_fn)(v, mesh.size, axis)
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(axis),
                               out_specs=tuple(P(axis) for _ in range(nouts)), check_vma=False))


def src_elems_for(variants: Sequence[Variant]) -> int:
  """Input elements per device that serve every variant (a multiple of 128, >= 128)."""
  need = max([v.src_elems for v in variants] + [TILE_COLS])
  return -(-need // TILE_COLS) * TILE_COLS


def src_aval(mesh, n_src: int, axis: str = AXIS) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((mesh.size * n_src,), DTYPE,
                              sharding=NamedSharding(mesh, P(axis)))


def make_src(mesh, n_src: int, axis: str = AXIS):
  """src [D * n_src] bf16 on the mesh: device r's element i is ((7 i + 13 r) % 251) - 125,
  exact in bf16 and different on every device (`expected_src` is the numpy copy)."""

  def gen():
    r = lax.axis_index(axis)
    i = lax.rem(lax.iota(jnp.int32, n_src), 251)  # no int32 overflow at any size
    return (lax.rem(7 * i + 13 * r, 251) - 125).astype(DTYPE)

  return jax.jit(jax.shard_map(gen, mesh=mesh, in_specs=(), out_specs=P(axis),
                               check_vma=False))()


def expected_src(num_devices: int, n_src: int) -> np.ndarray:
  i = np.arange(n_src, dtype=np.int64) % 251
  return np.stack([((7 * i + 13 * r) % 251) - 125 for r in range(num_devices)]).astype(np.float32)


# ---------------------------------------------------------------------------
# Lowering (no GPU needed).
# ---------------------------------------------------------------------------


def lower_variant(v: Variant, mesh, n_src: int, axis: str = AXIS, build=None) -> str:
  """Exports `v` for CUDA; returns the StableHLO text (which holds the Mosaic GPU module)."""
  exported = jax.export.export(sharded_fn(v, mesh, axis, build), platforms=["cuda"])(
      src_aval(mesh, n_src, axis))
  text = exported.mlir_module()
  if "mosaic_gpu" not in text:
    raise RuntimeError(f"{v.name}: no Mosaic GPU custom call in the exported module")
  return text


def pull_warpgroup_finding(mesh, axis: str = AXIS) -> str:
  """Whether a Warpgroup-semantics kernel can TMA-load from a peer: 'lowers' or the error."""
  v = Variant("pull", 1, bytes_per_cta=32 << 10, semantics="warpgroup")
  try:
    lower_variant(v, mesh, src_elems_for([v]), axis, build=_MOSAIC_KERNEL_FN)
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  return "lowers"


def lower_all(variants: Sequence[Variant], mesh, axis: str = AXIS) -> list[dict[str, Any]]:
  """Lowers every variant for CUDA; one row each: name, ok, the TMA instructions, error."""
  n_src = src_elems_for(variants)
  rows = []
  for v in variants:
    row: dict[str, Any] = dict(variant=v.name, semantics=v.lowering_semantics)
    try:
      text = lower_variant(v, mesh, n_src, axis)
      row.update(ok=True, tma=sorted(set(
          word for word in ("cp.async.bulk.global.shared::cta", "cp.async.bulk.shared::cta.global",
                            "cp.async.bulk.tensor", "globaltimer", "%clock") if word in text)))
    except Exception as e:  # pylint: disable=broad-except
      row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
    rows.append(row)
  return rows


# ---------------------------------------------------------------------------
# Timing and statistics.
# ---------------------------------------------------------------------------


def measure(compiled, args, *, kernel_name: str, iterations: int, warmup: int,
            num_devices: int, timer: str) -> dict[str, Any]:
  """Times one compiled variant with pallas_rs.bench.timing.

  CUPTI: the kernel's own records only (step time = max over devices, timing.py's rule);
  XLA's pre-launch multi-GPU barrier kernel is left out of `times_us` but kept in
  `step_times_us`. host_wall_clock (no GPU): one call per iteration, no claims.
  """
  timer = timing.resolve_timer(timer)
  if timer == "host_wall_clock":
    t = timing.time_function(compiled, args, iterations=iterations, warmup=warmup, timer=timer,
                             num_devices=num_devices)
    return dict(timer=t.timer, times_us=t.times_us, times_min_us=None, step_times_us=t.times_us,
                rule=t.rule, kernels=None, notes=t.notes)
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  # timing.time_function sums every kernel of a step; the records are needed per kernel name.
  per_iter, notes, paired = cupti.session_kernels(compiled, args, iterations, num_devices)
  step = timing.kernels_to_timing(per_iter, num_devices, paired=paired)
  # Filtering keeps a paired iteration's equal runs per device (one program on every device).
  mine = [[rec for rec in it if kernel_name in rec[0]] for it in per_iter]
  if not all(mine):
    raise RuntimeError(f"CUPTI saw no {kernel_name} record in some iteration; kernels: "
                       f"{sorted(step.kernels or {})}")
  kern = timing.kernels_to_timing(mine, num_devices, paired=paired)
  return dict(timer="cupti", times_us=kern.times_us, times_min_us=kern.times_min_us,
              step_times_us=step.times_us, rule=kern.rule, kernels=step.kernels,
              notes=notes + kern.notes)


def reference_gbps(mechanism: str, ctas: int, *, both_ways: bool = False
                   ) -> tuple[float | None, list[float] | None]:
  """(reference GB/s, its measured range) of the CUDA benchmark, or (None, None)."""
  table = REFERENCE_GBPS["push_both" if both_ways and mechanism == "push" else mechanism]
  ref = table.get(ctas)
  if ref is None:
    return None, None
  lo, hi = ref if isinstance(ref, tuple) else (ref, ref)
  return (lo + hi) / 2, [float(lo), float(hi)]


def gbps(nbytes: int, us: float) -> float:
  """GB/s (1e9 B/s) of `nbytes` in `us` microseconds."""
  return nbytes / us / 1e3


def bandwidth_record(v: Variant, t: dict[str, Any], *, num_devices: int) -> dict[str, Any]:
  """The JSON record of a timed push/pull/local variant."""
  stats = metrics.summarize(t["times_us"])
  total = gbps(v.bytes_moved, stats["median"])
  ref, ref_range = reference_gbps(v.mechanism, v.ctas)
  ref_both, _ = reference_gbps(v.mechanism, v.ctas, both_ways=True)
  record = dict(
      variant=v.name, mechanism=v.mechanism, layout=v.layout, ctas=v.ctas, inflight=v.inflight,
      bytes_per_cta=v.bytes_per_cta, chunk_bytes=v.chunk_bytes, bytes_moved_per_gpu=v.bytes_moved,
      num_devices=num_devices, one_way=v.one_way, handshake=v.handshake,
      lowering_semantics=v.lowering_semantics, kernel_name=v.kernel_name, status="ok",
      timer=t["timer"], rule=t["rule"], times_us=t["times_us"], times_min_us=t["times_min_us"],
      step_times_us=t["step_times_us"], kernels=t["kernels"], notes=t["notes"],
      stats=stats, median_us=stats["median"],
      step_median_us=float(np.median(t["step_times_us"])),
      gbps_total=total, gbps_per_sm=total / v.ctas,
      reference_gbps=ref, reference_range_gbps=ref_range,
      ratio=None if ref is None else total / ref,
      reference_both_ways_gbps=ref_both,
      ratio_both_ways=None if ref_both is None else total / ref_both,
  )
  if v.mechanism == "pull" and v.inflight != 4 and ref is not None:
    record["notes"] = record["notes"] + ["the pull reference is for 4 loads in flight"]
  return record


def _u32(a: np.ndarray) -> np.ndarray:
  """In-kernel int32 differences of 32-bit counters, as the unsigned values they are."""
  return np.asarray(a).astype(np.int64) & 0xFFFFFFFF


def hol_stats(lat: np.ndarray, v: Variant, num_devices: int) -> dict[str, Any]:
  """Latency statistics of the probe from `lat` [iterations, D, ctas, 2] (ns, cycles).

  Probing CTAs: those that stored (all active ranks' CTAs when none stored); `others`: the
  active ranks' remaining CTAs. us by %globaltimer; `*_clock_us` by %clock, converted with the
  cycles/ns ratio fitted on samples of >= 2 us (where the timer's step is negligible).
  """
  lat = np.asarray(lat)
  ns, cyc = _u32(lat[..., 0]), _u32(lat[..., 1])
  active = np.array([(not v.one_way) or r == 0 for r in range(num_devices)])
  cta = np.arange(v.ctas)
  stored = active[:, None] & (cta[None, :] < v.hol_store_ctas)
  probe = stored if stored.any() else active[:, None] & np.ones(v.ctas, bool)[None, :]
  others = active[:, None] & ~probe
  long = ns >= 2000
  cycles_per_ns = float(np.median(cyc[long] / ns[long])) if long.any() else None
  steps = np.diff(np.unique(ns))
  return dict(
      probe_ctas_per_device=int(probe[0].sum()),  # rank 0 is always active
      probe_median_us=float(np.median(ns[:, probe])) / 1e3,
      probe_p90_us=float(np.percentile(ns[:, probe], 90)) / 1e3,
      probe_median_cycles=float(np.median(cyc[:, probe])),
      others_median_us=float(np.median(ns[:, others])) / 1e3 if others.any() else None,
      cycles_per_ns=cycles_per_ns,
      probe_median_clock_us=(float(np.median(cyc[:, probe])) / cycles_per_ns / 1e3
                             if cycles_per_ns else None),
      globaltimer_step_ns_observed=float(steps.min()) if steps.size else None,
      per_iteration_probe_median_us=[float(np.median(x[probe])) / 1e3 for x in ns],
      per_cta_median_us=(np.median(ns, axis=0) / 1e3).tolist(),
  )


def apply_clock_fit(hol_records: Sequence[dict]) -> float | None:
  """Converts every case's median cycles to us with one cycles/ns ratio, the median of the
  cases' own fits (short cases, e.g. 'none' at ~0.6 us, cannot fit their own). Returns it."""
  fits = [r["latency"]["cycles_per_ns"] for r in hol_records
          if r.get("status") == "ok" and r["latency"]["cycles_per_ns"]]
  if not fits:
    return None
  pooled = float(np.median(fits))
  for r in hol_records:
    if r.get("status") == "ok":
      lat = r["latency"]
      lat["cycles_per_ns_pooled"] = pooled
      lat["probe_median_clock_us"] = lat["probe_median_cycles"] / pooled / 1e3
  return pooled


def hol_record(v: Variant, t: dict[str, Any], lat: np.ndarray, *, num_devices: int
               ) -> dict[str, Any]:
  stats = hol_stats(lat, v, num_devices)
  # The CUDA probe loaded 32 KB after the store; other sizes have no reference.
  ref = REFERENCE_HOL_US.get(v.hol_case) if v.hol_load_bytes == 32 << 10 else None
  target, which, kb = HOL_CASES[v.hol_case]
  return dict(
      variant=v.name, mechanism="hol", case=v.hol_case, ctas=v.ctas, store_target=target,
      store_ctas=v.hol_store_ctas, store_bytes=v.hol_store_bytes, load_bytes=v.hol_load_bytes,
      num_devices=num_devices, one_way=v.one_way, lowering_semantics=v.lowering_semantics,
      kernel_name=v.kernel_name, status="ok", clock="in-kernel %globaltimer (ns) and %clock "
      "(cycles) around the load's barrier wait", timer=t["timer"], times_us=t["times_us"],
      step_times_us=t["step_times_us"], kernel_median_us=float(np.median(t["times_us"])),
      latency=stats, reference_us=ref,
      ratio=None if ref is None else stats["probe_median_us"] / ref,
      notes=t["notes"] + [f"store: {kb} KiB to {target or 'nowhere'} from {which} CTAs"],
  )


# ---------------------------------------------------------------------------
# Checks of the moved data (small variants).
# ---------------------------------------------------------------------------


def expected_output(v: Variant, src: np.ndarray, num_devices: int) -> list[np.ndarray | None]:
  """Per device, the flat output a check variant must produce (None: unconstrained)."""
  assert v.check and v.mechanism in ("push", "pull", "local"), v
  n, ce = v.chunks_per_cta, v.chunk_elems
  chunks = lambda r: src[r].reshape(-1, ce)
  active = lambda r: (not v.one_way) or r == 0
  outs = []
  for r in range(num_devices):
    if v.mechanism == "pull":
      q = (r + 1) % num_devices
      outs.append(chunks(q)[: v.ctas * n].reshape(-1) if active(r) else None)
      continue
    q = (r - 1) % num_devices if v.mechanism == "push" else r  # who wrote rank r's dst
    if not active(q):
      outs.append(None)
      continue
    idx = [c * v.inflight + j % v.inflight for c in range(v.ctas) for j in range(n)]
    outs.append(chunks(q)[idx].reshape(-1))
  return outs


def check_record(v: Variant, outs, src: np.ndarray, num_devices: int) -> dict[str, Any]:
  got = np.asarray(jax.device_get(outs[0])).astype(np.float32).reshape(num_devices, -1)
  src = src[:, : v.src_elems]
  want = expected_output(v, src, num_devices)
  bad = {r: int(np.sum(got[r] != w)) for r, w in enumerate(want) if w is not None}
  return dict(variant=v.name, mechanism=v.mechanism, layout=v.layout,
              lowering_semantics=v.lowering_semantics, ok=not any(bad.values()),
              mismatched_elements=bad, checked_devices=sorted(bad))


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------


def _cell(record: dict | None) -> str:
  if record is None:
    return "-"
  if record.get("status") != "ok":
    return "skip" if str(record.get("status", "")).startswith("skipped") else "fail"
  ratio = record.get("ratio")
  return f"{record['gbps_total']:.0f}" + (f"/{ratio:.2f}" if ratio is not None else "")


def _label(record: dict) -> str:
  """push, pull/wg, local/tiled, ...: mechanism, then what differs from the defaults."""
  label = record["mechanism"]
  if record.get("layout", "flat") != "flat":
    label += f"/{record['layout']}"
  if record["mechanism"] == "pull" and record.get("lowering_semantics") == "warpgroup":
    label += "/wg"
  return label


def bandwidth_table(records: Sequence[dict], ctas: Sequence[int]) -> str:
  """mechanism x inflight rows, CTA columns: 'GB/s per GPU / ratio to the CUDA figure'."""
  keys = []
  by_key = {}
  for r in records:
    key = (_label(r), r["inflight"])
    if key not in by_key:
      keys.append(key)
      by_key[key] = {}
    by_key[key][r["ctas"]] = r
  head = f"{'mechanism':16} {'infl':>4} |" + "".join(f"{c:>10}" for c in ctas)
  lines = [head, "-" * len(head)]
  for key in keys:
    label, inflight = key
    lines.append(f"{label:16} {inflight:>4} |"
                 + "".join(f"{_cell(by_key[key].get(c)):>10}" for c in ctas))
  return "\n".join(lines)


def both_ways_line(records: Sequence[dict]) -> str:
  """Push ratios to the CUDA figures of both GPUs pushing at once (what --directions=both
  does), where that reference exists."""
  cells = [f"i{r['inflight']}@{r['ctas']}:{r['ratio_both_ways']:.2f}" for r in records
           if r.get("status") == "ok" and r["mechanism"] == "push" and r["layout"] == "flat"
           and r.get("ratio_both_ways") is not None]
  ref = ", ".join(f"{v}@{c}" for c, v in REFERENCE_GBPS["push_both"].items())
  return f"push / CUDA both-GPUs-pushing reference ({ref}): " + (" ".join(cells) or "-")


def hol_table(records: Sequence[dict]) -> str:
  head = (f"{'case':14} {'probe_us':>9} {'clock_us':>9} {'ref_us':>7} {'ratio':>6} "
          f"{'others_us':>9} {'kernel_us':>9}")
  lines = [head, "-" * len(head)]
  for r in records:
    if r.get("status") != "ok":
      lines.append(f"{r['case']:14} {r.get('status', '')[:60]}")
      continue
    lat = r["latency"]
    lines.append(
        f"{r['case']:14} {lat['probe_median_us']:9.2f} "
        f"{bench_env.fmt(lat['probe_median_clock_us']):>9} {bench_env.fmt(r['reference_us']):>7} "
        f"{bench_env.fmt(r['ratio']):>6} {bench_env.fmt(lat['others_median_us']):>9} "
        f"{r['kernel_median_us']:9.1f}")
  return "\n".join(lines)


def plot(records: Sequence[dict], path: Path, *, title: str) -> str | None:
  """GB/s per GPU vs CTAs (log x), a line per mechanism/layout/inflight, the CUDA reference
  dashed; returns None, or why no PNG was written."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return f"no PNG: {e}"
  fig, ax = plt.subplots(figsize=(8, 5.5))
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    if r.get("status") == "ok":
      groups.setdefault((r["mechanism"], _label(r), r["inflight"]), []).append(r)
  colors = {"push": "tab:blue", "pull": "tab:orange", "local": "tab:green"}
  styles = {1: "o-", 2: "s-", 4: "^-"}
  all_ctas = set()
  for (mech, label, inflight), rows in groups.items():
    rows = sorted(rows, key=lambda r: r["ctas"])
    all_ctas.update(r["ctas"] for r in rows)
    ax.plot([r["ctas"] for r in rows], [r["gbps_total"] for r in rows],
            styles.get(inflight, "x-"), color=colors.get(mech),
            label=f"{label}, {inflight} in flight", alpha=1.0 if label == mech else 0.55)
  refs = [(m, m) for m in sorted({m for m, _, _ in groups})]
  if "push" in {m for m, _, _ in groups}:
    refs.append(("push", "push_both"))
  for mech, key in refs:
    xs = sorted(REFERENCE_GBPS[key])
    ys = [reference_gbps(mech, c, both_ways=key == "push_both")[0] for c in xs]
    ax.plot(xs, ys, ":" if key == "push_both" else "--", color=colors.get(mech), linewidth=1,
            label=f"{'push, both GPUs' if key == 'push_both' else mech}, CUDA reference")
  ax.set_xscale("log", base=2)
  if all_ctas:
    ax.set_xticks(sorted(all_ctas))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.set_yscale("log")
  ax.set_xlabel("CTAs per GPU (one per SM)")
  ax.set_ylabel("GB/s per GPU (bytes one GPU moves / kernel time)")
  ax.set_title(title, fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


# ---------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------


def require_gpus(num_devices: int) -> list:
  """The first `num_devices` GPUs, or a UsageError saying what is missing."""
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if num_devices < 2 or len(gpus) < num_devices:
    raise app.UsageError(
        f"nvlink_roofline.py measures NVLink between GPUs: it needs --num_devices >= 2 and that "
        f"many GPUs; found {len(gpus)} GPU(s) (backend {jax.default_backend()!r}), "
        f"--num_devices={num_devices}. --lower_only lowers every variant without a GPU.")
  return gpus[:num_devices]


def num_sms(devices) -> int:
  """SMs of the first device; DEFAULT_NUM_SMS off a GPU (lowering, stand-in tests)."""
  dev = devices[0]
  return (getattr(dev, "core_count", None) if dev.platform == "gpu" else None) or DEFAULT_NUM_SMS


def _configure(lower_only: bool) -> None:
  """Environment before the first backend use: NVLS off; the default (BFC) allocator, which
  Mosaic GPU collectives need (jax's own tests: the platform allocator does not work); CPU
  devices for --lower_only."""
  nvls = os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
  if nvls != "0":
    raise app.UsageError(f"NCCL_NVLS_ENABLE={nvls!r}: NVLink multicast must stay off; unset "
                         "it or set it to 0")
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
  if lower_only:
    bench_env.use_host_devices()


def _ints(values: Sequence[str]) -> list[int]:
  return [int(x) for x in values]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  t_start = time.time()
  lower_only = _LOWER_ONLY.value
  _configure(lower_only)
  d = _NUM_DEVICES.value
  mechanisms = _MECHANISMS.value
  if bad := set(mechanisms) - set(MECHANISMS):
    raise app.UsageError(f"--mechanisms: {sorted(bad)} not in {MECHANISMS}")
  one_way = _DIRECTIONS.value == "one"
  common = dict(bytes_per_cta=_BYTES_PER_CTA_KB.value << 10, chunk_bytes=_CHUNK_KB.value << 10,
                one_way=one_way)
  out_path = Path(_OUT.value) if _OUT.value else bench_env.default_out("nvlink_roofline.json")

  if lower_only:
    devices = jax.devices()[:d]
    if len(devices) < d:
      raise app.UsageError(f"--lower_only needs {d} devices, have {len(devices)}")
  else:
    devices = require_gpus(d)
  sms = num_sms(devices)
  ctas = _ints(_CTAS.value)
  hol_ctas = _HOL_CTAS.value or sms
  mesh = jax.make_mesh((d,), (AXIS,), devices=devices)
  if bad := set(_PULL_SEMANTICS.value) - {"lane", "warpgroup"}:
    raise app.UsageError(f"--pull_semantics: {sorted(bad)} not in lane, warpgroup")
  wg_pull = pull_warpgroup_finding(mesh)
  pull_semantics = [s for s in _PULL_SEMANTICS.value if s == "lane" or wg_pull == "lowers"]
  bw = [dataclasses.replace(v, handshake=v.mechanism == "pull" and _PULL_HANDSHAKE.value)
        for v in bandwidth_variants(mechanisms, ctas, _ints(_INFLIGHT.value), _LAYOUTS.value,
                                    pull_semantics=pull_semantics, **common)]
  hol = hol_variants(_HOL_CASES.value, hol_ctas, load_bytes=_HOL_LOAD_KB.value << 10,
                     one_way=one_way) if "hol" in mechanisms else []
  checks = check_variants(mechanisms, _LAYOUTS.value, chunk_bytes=common["chunk_bytes"],
                          one_way=one_way, handshake=_PULL_HANDSHAKE.value,
                          pull_semantics=pull_semantics) if _CHECK.value else []

  record: dict[str, Any] = dict(
      environment=bench_env.environment_block(sys.argv),
      flags={holder.name: holder.value for holder in _ALL_FLAGS},
      settings=dict(
          num_devices=d, directions=_DIRECTIONS.value, sms=sms, dtype="bfloat16",
          chunk_layouts={"flat": "1-D contiguous chunks: cp.async.bulk (no tensor map, peer "
                                 "address resolved on the device)",
                         "tiled": "[rows, 128] bf16 tiles, (8, 64) tiling + 128 B swizzle: "
                                  "cp.async.bulk.tensor through a host-built descriptor"},
          lowering_semantics=dict(push="warpgroup", local="warpgroup", hol="warpgroup",
                                  pull=pull_semantics),
          gbps="bytes one GPU moves (ctas x bytes_per_cta) / median kernel time; kernel time = "
               "max over devices of the kernel's CUPTI duration (pallas_rs.bench.timing), XLA's "
               "pre-launch barrier kernel excluded",
          XLA_PYTHON_CLIENT_ALLOCATOR=os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"),
          performance_claims=False,  # set once the timer is known
      ),
      reference=dict(gbps={k: {c: list(v) if isinstance(v, tuple) else v
                               for c, v in t.items()} for k, t in REFERENCE_GBPS.items()},
                     hol_us=REFERENCE_HOL_US, source=REFERENCE_SOURCE),
      findings=dict(pull_warpgroup_semantics=wg_pull), lowering=[], checks=[], records=[],
      hol=[])
  if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") != "default":
    record["settings"]["allocator_note"] = ("XLA_PYTHON_CLIENT_ALLOCATOR=default is recommended "
                                            "for Mosaic GPU collectives")

  def save():
    record["wall_s"] = time.time() - t_start
    bench_env.write_json(out_path, bench_env.sanitize(record))

  if lower_only:
    record["lowering"] = lower_all(checks + bw + hol, mesh)
    save()
    failed = [r for r in record["lowering"] if not r["ok"]]
    print(f"wrote {out_path}")
    print(f"pull in Warpgroup semantics: {record['findings']['pull_warpgroup_semantics']}")
    for r in failed:
      print(f"FAILED {r['variant']}: {r['error'][:300]}")
    print(f"lowered {len(record['lowering']) - len(failed)}/{len(record['lowering'])} variants "
          f"for CUDA at D = {d}")
    return 1 if failed else 0

  n_src = src_elems_for(checks + bw + hol)
  src = make_src(mesh, n_src)
  # The check variants read only the input's first src_elems_for(checks) elements.
  src_np = expected_src(d, src_elems_for(checks)) if checks else None
  timer = timing.resolve_timer(_TIMER.value)
  record["settings"]["performance_claims"] = timer == "cupti"
  settings = dict(iterations=_ITERATIONS.value, warmup=_WARMUP.value, num_devices=d, timer=timer)

  def over_budget() -> bool:
    return time.time() - t_start > _TIME_BUDGET_S.value

  for v in checks:
    try:
      outs = sharded_fn(v, mesh)(src)
      row = check_record(v, outs, src_np, d)
    except Exception as e:  # pylint: disable=broad-except
      row = dict(variant=v.name, mechanism=v.mechanism, lowering_semantics=v.lowering_semantics,
                 ok=False, error=repr(e)[:800])
    record["checks"].append(row)
    print("check", row, flush=True)
  for sem in pull_semantics:
    rows = [c for c in record["checks"]
            if c["mechanism"] == "pull" and c.get("lowering_semantics") == sem]
    record["findings"][f"remote_tma_load_{sem}"] = (
        "checked: pulled data equal to the peer's input" if rows and all(c["ok"] for c in rows)
        else "failed (see checks)" if rows else "not checked")
  save()

  for v in bw + hol:
    base = dict(variant=v.name, mechanism=v.mechanism, ctas=v.ctas,
                lowering_semantics=v.lowering_semantics)
    if v.mechanism == "hol":
      base["case"] = v.hol_case
    else:
      base.update(layout=v.layout, inflight=v.inflight)
    if v.ctas > sms:
      row = dict(base, status=f"skipped: {v.ctas} CTAs > {sms} SMs")
    elif over_budget():
      row = dict(base, status=f"skipped: --time_budget_s={_TIME_BUDGET_S.value} spent")
    else:
      t0 = time.time()
      try:
        compiled = sharded_fn(v, mesh).lower(src).compile()
        t = measure(compiled, (src,), kernel_name=v.kernel_name, **settings)
        if v.mechanism == "hol":
          lat = [np.asarray(jax.device_get(compiled(src)[0])).reshape(d, v.ctas, 2)
                 for _ in range(_ITERATIONS.value)]
          row = hol_record(v, t, np.stack(lat), num_devices=d)
        else:
          row = bandwidth_record(v, t, num_devices=d)
        row["wall_s"] = time.time() - t0
      except Exception as e:  # pylint: disable=broad-except
        row = dict(base, status=f"failed: {e!r}"[:800])
    record["hol" if v.mechanism == "hol" else "records"].append(row)
    summary = {k: row.get(k) for k in ("variant", "status", "median_us", "gbps_total", "ratio")
               if k in row}
    if v.mechanism == "hol" and row.get("status") == "ok":
      summary.update(kernel_us=row["kernel_median_us"],
                     probe_us=row["latency"]["probe_median_us"])
    print(summary, flush=True)
    save()

  directions = "one direction" if one_way else "both directions"
  title = (f"NVLink primitives, Mosaic GPU, D = {d} ({directions}), "
           f"{_BYTES_PER_CTA_KB.value} KiB per CTA, {_CHUNK_KB.value} KiB copies; "
           f"{record['environment']['device_kind']}")
  record["settings"]["hol_cycles_per_ns"] = apply_clock_fit(record["hol"])
  png = out_path.with_suffix(".png")
  why = plot(record["records"], png, title=title)
  record["plot"] = why or str(png)
  save()

  failed = [c for c in record["checks"] if not c["ok"]] + [
      r for r in record["records"] + record["hol"] if str(r.get("status")).startswith("failed")]
  print(f"\nwrote {out_path}" + (f" and {png}" if why is None else f" ({why})"))
  print(f"pull in Warpgroup semantics: {record['findings']['pull_warpgroup_semantics']}")
  print("checks: " + (", ".join(f"{c['variant']}={'ok' if c['ok'] else 'FAIL'}"
                                for c in record["checks"]) or "none"))
  if record["records"]:
    print(f"\n{title}\nGB/s per GPU / ratio to the CUDA reference (pull reference: 4 in flight; "
          f"push reference: one GPU pushing)")
    print(bandwidth_table(record["records"], ctas))
    if not one_way:
      print(both_ways_line(record["records"]))
  if record["hol"]:
    print(f"\nhead-of-line: {_HOL_LOAD_KB.value} KiB local TMA load after a TMA store (us, "
          "median over the storing CTAs; all CTAs for 'none'; ref: CUDA, 32 KB)")
    print(hol_table(record["hol"]))
  return 1 if failed else 0


if __name__ == "__main__":
  app.run(main)
