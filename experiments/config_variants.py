"""Config variants by name, for the experiment scripts (overlap_probe.py, ablate.py).

A name is "_"-separated tokens applied in order to a base config (`variant_config`), e.g.
"p4_ring" (4 pulling comm CTAs, unfused_order numerics) or "t64x128_s4" (64 x 128 warpgroup
tiles, a 4-step pipeline); the usual base is `tuned_config`.
"""
from __future__ import annotations

import dataclasses
import re


def tuned_config(*, m: int, k_shard: int, n: int, dtype, num_devices: int):
  """The config implementation="fused" runs for the shape on this GPU kind: the tuning table's,
  else the kernel's default (pallas_rs.tuning.gate.decide). NotImplementedError where the
  kernel cannot take the shape."""
  from pallas_rs import platform  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import gate  # pylint: disable=g-import-not-at-top
  return gate.decide("matmul_rs", m=m, k_shard=k_shard, n=n, dtype=dtype,
                     num_devices=num_devices, implementation="fused",
                     gpu_kind=platform.device_kind()).config.config


def variant_config(base, name: str):
  """The config of a variant name, "_"-separated tokens applied to `base`: v1 (as is: the
  direct push), cN (N comm CTAs pushing), pN (N comm CTAs pulling), ow (no comm CTAs, the
  owner's epilogue loads the staged partials: comm_mode "owner", no TMA add, the CTA tile's
  warpgroups along N where they can be), oN (N epilogue SMEM
  slots), tMxN (warpgroup tile M x N: tile_m, tile_n), wm / wn (the two warpgroup tiles side by
  side along M / N: config.wg_dimension), sK (K pipeline steps), rK (K receive prefetch stages
  of the owner's sum: recv_stages), eK (epilogue sub-tiles K columns wide), tadd (the owner's
  sum by TMA add: tma_add; D = 2 in the ring's numerics, D > 2 with pN, ring or fp32 partials),
  noadd (tma_add off), il / st (the
  remote steps interleaved tile by tile / one after the other: interleave_steps), f32 / bf16
  (partial dtype), ring (numerics mode "unfused_order"), gK (tile order: snake bands K tiles
  wide, grid_tile_width), gm / gn (the bands' minor dimension M / N: grid_minor_dim); then
  fitted to SMEM at D = 2
  (`config.fit_smem`). "table" is accepted as a no-op (the base is the table's config)."""
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = base
  for token in name.split("_"):
    tile = re.fullmatch(r"t(\d+)x(\d+)", token)
    if token in ("f32", "bf16"):
      cfg = config_lib.with_partial_dtype(
          cfg, "float32" if token == "f32" else "bfloat16", 2)
    elif token == "ring":
      cfg = config_lib.with_numerics(cfg, "unfused_order", 2)
    elif tile:
      tile_m, tile_n = int(tile[1]), int(tile[2])
      cfg = dataclasses.replace(cfg, tile_m=tile_m, tile_n=tile_n,
                                epi_tile_n=min(cfg.epi_tile_n, tile_n))
    elif token in ("tadd", "noadd"):
      cfg = dataclasses.replace(cfg, tma_add=token == "tadd")
    elif token == "ow":
      cfg = dataclasses.replace(cfg, comm_mode="owner", comm_ctas=0, tma_add=False)
      try:  # Without the add NVLink runs the N split only (fused.nvlink_unverified).
        cfg = config_lib.with_wg_along_n(cfg)
      except NotImplementedError:
        pass  # (the kernel's check then names why the variant cannot run)
    elif token in ("il", "st"):
      cfg = dataclasses.replace(cfg, interleave_steps=token == "il")
    elif token in ("wm", "wn"):
      cfg = dataclasses.replace(cfg, wg_dimension=config_lib.MatmulDimension[token[1].upper()])
    elif token in ("gm", "gn"):
      cfg = dataclasses.replace(cfg, grid_minor_dim=config_lib.MatmulDimension[token[1].upper()])
    elif token[0] == "g" and token[1:].isdigit():
      cfg = dataclasses.replace(cfg, grid_tile_width=int(token[1:]))
    elif token[0] == "s" and token[1:].isdigit():
      cfg = dataclasses.replace(cfg, max_concurrent_steps=int(token[1:]))
    elif token[0] == "r" and token[1:].isdigit():
      cfg = dataclasses.replace(cfg, recv_stages=int(token[1:]))
    elif token[0] == "e" and token[1:].isdigit():
      cfg = dataclasses.replace(cfg, epi_tile_n=int(token[1:]))
    elif token[0] in "cpo" and token[1:].isdigit():
      field = "out_slots" if token[0] == "o" else "comm_ctas"
      cfg = dataclasses.replace(cfg, **{field: int(token[1:])})
      if token[0] == "p":
        cfg = dataclasses.replace(cfg, comm_mode="pull")
    elif token not in ("v1", "table"):
      raise ValueError(f"unknown variant token {token!r} in {name!r}")
  return config_lib.fit_smem(cfg, 2)
