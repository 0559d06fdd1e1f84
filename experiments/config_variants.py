"""Config variants by name, for the experiment scripts (overlap_probe.py, ablate.py).

A name is "_"-separated tokens applied in order to a base config (`variant_config`), e.g.
"p4_ring" (4 pulling comm CTAs, unfused_order numerics) or "t64x128_s4" (64 x 128 warpgroup
tiles, a 4-step pipeline); the usual base is `tuned_config`.
"""
from __future__ import annotations

import dataclasses
import re


def tuned_config(*, m: int, k_shard: int, n: int, dtype, num_devices: int,
                 gpu_kind: str | None = None):
  """The config implementation="fused" runs for the shape on `gpu_kind` (default this GPU's):
  the tuning table's, else the kernel's default (pallas_rs.tuning.gate.decide).
  NotImplementedError where the kernel cannot take the shape."""
  from pallas_rs import platform  # pylint: disable=g-import-not-at-top
  from pallas_rs.tuning import gate  # pylint: disable=g-import-not-at-top
  return gate.decide("matmul_rs", m=m, k_shard=k_shard, n=n, dtype=dtype,
                     num_devices=num_devices, implementation="fused",
                     gpu_kind=gpu_kind or platform.device_kind()).config.config


def variant_config(base, name: str, num_devices: int = 2):
  """The config of a variant name, "_"-separated tokens applied to `base`: v1 (as is: the direct
  push), cN (N comm CTAs pushing), pN (N comm CTAs pulling), ow (no comm CTAs, the owner's
  epilogue loads the staged partials: comm_mode "owner", no TMA add, the CTA tile's warpgroups
  along N where they can be), oN (N epilogue SMEM slots), tMxN (warpgroup tile M x N: tile_m,
  tile_n), wm / wn (the two warpgroup tiles side by side along M / N: config.wg_dimension), sK
  (K pipeline steps), rK (K receive prefetch stages of the owner's sum: recv_stages), eK
  (epilogue sub-tiles K columns wide), tadd (the owner's sum by TMA add: tma_add; D = 2 in the
  ring's numerics, D > 2 with pN, ring or fp32 partials), noadd (tma_add off), il / st (the
  remote steps interleaved tile by tile / one after the other: interleave_steps), pf / nopf (the
  next tile's blocks loaded during this tile's end: prefetch_tiles), ss / noss (a tile's stores
  spread over the next tile's k blocks: spread_stores, with deferred signals), pp / nopp (the
  two warpgroup tiles in turn through one SMEM ring: pingpong; pp turns pf and ss off), f32 / bf16
  (partial dtype), ring (numerics mode "unfused_order"), gK (tile order: snake bands K tiles
  wide, grid_tile_width), gm / gn (the bands' minor dimension M / N: grid_minor_dim); then
  fitted to SMEM at `num_devices` (`config.fit_smem`; D = 1 has no partials' SMEM, so a pipeline
  that fits there alone stays as deep). "table" is accepted as a no-op (the base is the table's
  config)."""
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = base
  for token in name.split("_"):
    apply, match = _parse(token, name)
    cfg = apply(cfg, match, config_lib)
  return config_lib.fit_smem(cfg, num_devices)


def check_name(name: str) -> None:
  """ValueError if `name` has a token `variant_config` does not know (no config needed)."""
  for token in name.split("_"):
    _parse(token, name)


def _parse(token: str, name: str):
  for pattern, apply in _TOKENS:
    match = re.fullmatch(pattern, token)
    if match:
      return apply, match
  raise ValueError(f"unknown variant token {token!r} in {name!r}")


def _tile(cfg, match, lib):
  return lib.with_tile(cfg, int(match[1]), int(match[2]))


def _owner(cfg, match, lib):
  del match
  cfg = dataclasses.replace(cfg, comm_mode="owner", comm_ctas=0, tma_add=False)
  try:  # Without the add NVLink runs the N split only (fused.nvlink_unverified).
    return lib.with_wg_along_n(cfg)
  except NotImplementedError:
    return cfg  # (the kernel's check then names why the variant cannot run)


def _int_field(field: str, **more):
  return lambda cfg, match, lib: dataclasses.replace(cfg, **{field: int(match[1])}, **more)


def _dim_field(field: str):
  return lambda cfg, match, lib: dataclasses.replace(
      cfg, **{field: lib.MatmulDimension[match[1].upper()]})


# (token pattern, what it does to a config), in variant_config's docstring order.
_TOKENS = (
    (r"v1|table", lambda cfg, match, lib: cfg),
    (r"c(\d+)", _int_field("comm_ctas")),
    (r"p(\d+)", _int_field("comm_ctas", comm_mode="pull")),
    (r"ow", _owner),
    (r"o(\d+)", _int_field("out_slots")),
    (r"t(\d+)x(\d+)", _tile),
    (r"w([mn])", _dim_field("wg_dimension")),
    (r"s(\d+)", _int_field("max_concurrent_steps")),
    (r"r(\d+)", _int_field("recv_stages")),
    (r"e(\d+)", _int_field("epi_tile_n")),
    (r"tadd|noadd", lambda cfg, match, lib: dataclasses.replace(cfg, tma_add=match[0] == "tadd")),
    (r"il|st", lambda cfg, match, lib: dataclasses.replace(
        cfg, interleave_steps=match[0] == "il")),
    (r"pf|nopf", lambda cfg, match, lib: dataclasses.replace(
        cfg, prefetch_tiles=match[0] == "pf")),
    (r"ss|noss", lambda cfg, match, lib: lib.with_spread(cfg, match[0] == "ss")),
    (r"pp|nopp", lambda cfg, match, lib: dataclasses.replace(
        cfg, pingpong=match[0] == "pp", **({"prefetch_tiles": False, "spread_stores": False}
                                           if match[0] == "pp" else {}))),
    (r"f32|bf16", lambda cfg, match, lib: lib.with_partial_dtype(
        cfg, "float32" if match[0] == "f32" else "bfloat16", 2)),
    (r"ring", lambda cfg, match, lib: lib.with_numerics(cfg, "unfused_order", 2)),
    (r"g(\d+)", _int_field("grid_tile_width")),
    (r"g([mn])", _dim_field("grid_minor_dim")),
)
