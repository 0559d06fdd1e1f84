"""pallas_rs.tuning: table lookup, heuristic, defaults, overrides, schema (CPU)."""
import copy
import dataclasses
import functools
import json
import re
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from pallas_rs.kernel import ag_matmul
from pallas_rs.tuning import candidates
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import defaults
from pallas_rs.kernel import fused
from pallas_rs.tuning import gate
from pallas_rs import platform
from pallas_rs import tuning
from pallas_rs.tuning import schema

H200 = "NVIDIA H200"
# A llama70b o_proj-like family at D = 8: n = 8192, k_shard = 1024.
N, K_SHARD = 8192, 1024


def _entry(m, implementation="fused", *, d=8, n=N, k_shard=K_SHARD, gpu_kind=H200,
           cfg=None, mode=None, fused_us=(10.0, 11.0), xla_us=(12.0, 13.0)):
  if cfg is None and implementation == "fused":
    cfg = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
  entry = {
      "key": {"gpu_kind": gpu_kind, "num_devices": d, "m": m, "n": n,
              "k_shard": k_shard, "dtype": "bfloat16"},
      "implementation": implementation,
      "config": tuning.config_to_json(cfg) if cfg is not None else None,
      "times_us": {"fused": list(fused_us), "xla": list(xla_us)},
      "env": {"jax_version": "test"},
      "measured_with": "tests/test_tuning.py",
  }
  if mode is not None:
    entry["mode"] = mode
  return entry


def _table(*entries):
  return {"schema_version": 1, "entries": list(entries)}


class _Choice(NamedTuple):
  implementation: str
  config: Any  # the Config "fused" runs (for "xla": would run if forced; None: cannot)
  source: str  # "table", "heuristic", "default" (tuning.select's) or "override"
  reason: str


def _choose(m, *, d=8, n=N, k_shard=K_SHARD, dtype="bfloat16", gpu_kind=H200, **kw):
  """`gate.decide`'s "auto" for a matmul_rs shape on `gpu_kind` (the shape-level decision),
  with the source read off its reason and the config unwrapped."""
  args = dict(m=m, n=n, k_shard=k_shard, dtype=dtype, num_devices=d, gpu_kind=gpu_kind, **kw)
  dec = gate.decide("matmul_rs", **args)
  tuned = re.match(r"tuning \((\w+)\): ", dec.reason)
  source = (tuned.group(1) if tuned else
            "override" if dec.reason.startswith("explicit config") else "default")
  if dec.implementation == "fused":
    config = dec.config.config
  else:
    try:
      config = gate.decide("matmul_rs", **dict(args, implementation="fused")).config.config
    except NotImplementedError:
      config = None
  return _Choice(dec.implementation, config, source, dec.reason)


@pytest.fixture(autouse=True)
def _no_env_table(monkeypatch):
  monkeypatch.delenv(tuning.ENV_VAR, raising=False)


# ---------------------------------------------------------------------------
# Lookup order.
# ---------------------------------------------------------------------------


def test_exact_hit_uses_table_config_and_gate():
  cfg = config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=3)
  table = _table(_entry(4096, cfg=cfg), _entry(16384, "xla"))
  d = _choose(4096, table=table)
  assert (d.implementation, d.config, d.source) == ("fused", cfg, "table")
  assert "fused median 10.5 us" in d.reason and "4096" in d.reason
  d = _choose(16384, table=table)
  assert (d.implementation, d.source) == ("xla", "table")
  # gpu_kind matches case- and whitespace-insensitively; another GPU does not.
  assert _choose(4096, table=table, gpu_kind="nvidia  h200").source == "table"
  assert _choose(4096, table=table, gpu_kind="NVIDIA H100 80GB HBM3").source == "default"


def test_heuristic_nearest_m_in_log_distance():
  small = config_lib.Config(tile_m=64, tile_n=128, max_concurrent_steps=3)
  table = _table(_entry(1024, cfg=small), _entry(65536, "xla"))
  # log-distance: 4096 is 2 octaves from 1024, 4 from 65536.
  d = _choose(4096, table=table)
  assert (d.implementation, d.config, d.source) == ("fused", small, "heuristic")
  assert "nearest measured shape m=1024" in d.reason and "roofline" in d.reason
  d = _choose(32768, table=table)
  assert (d.implementation, d.source) == ("xla", "heuristic")
  assert d.config == defaults.default_config(m=32768, n=N, k_shard=K_SHARD,
                                               num_devices=8)
  # Same (gpu_kind, D, n, k_shard) only: another k_shard or D is no neighbour.
  assert _choose(4096, table=table, k_shard=2048).source == "default"
  assert _choose(4096, table=table, d=4).source == "default"


# A 256-row CTA tile (128 x 128 warpgroup tiles stacked along M): it tiles m = 8192 at D = 8
# (1024-row chunks), not m = 512 (64-row chunks take CTA tiles of 64 rows, or 128 as pairs).
_BIG = config_lib.Config(tile_m=128, tile_n=128, wg_dimension=config_lib.MatmulDimension.M)


def test_heuristic_revalidates_config_and_falls_through():
  big = _BIG
  d = _choose(512, table=_table(_entry(8192, cfg=big)))
  assert (d.implementation, d.source) == ("xla", "default")
  assert "does not fit" in d.reason
  assert d.config == defaults.default_config(m=512, n=N, k_shard=K_SHARD,
                                               num_devices=8)


def test_exact_entry_with_unfit_config_falls_through_to_heuristic():
  big = _BIG
  ok = config_lib.Config(tile_m=64, tile_n=128)
  table = _table(_entry(512, cfg=big), _entry(1024, cfg=ok))
  d = _choose(512, table=table)
  assert (d.implementation, d.config, d.source) == ("fused", ok, "heuristic")


@pytest.mark.parametrize("d", [1, 2, 8])
def test_default_is_xla_without_measurement(d):
  dec = _choose(8192, d=d, table=tuning.empty_table())
  assert (dec.implementation, dec.source) == ("xla", "default")
  assert "no measurement" in dec.reason
  assert dec.config == defaults.default_config(m=8192, n=N, k_shard=K_SHARD,
                                                 num_devices=d)


def test_loopback_entries_never_gate():
  table = _table(_entry(4096, mode="loopback"))
  dec = _choose(4096, table=table)
  assert (dec.implementation, dec.source) == ("xla", "default")
  dec = _choose(2048, table=table)
  assert dec.source == "default"


@pytest.mark.parametrize("kw,match", [
    (dict(m=256), "below the smallest tile"),              # m // 8 = 32 rows
    (dict(m=8 * 96), "not a multiple of 64"),              # chunk 96
    (dict(m=4096, k_shard=1000), "k_shard=1000"),
    (dict(m=4096, n=8200), "n=8200"),
    (dict(m=4096, dtype=jnp.float32), "float32"),
    (dict(m=4096, d=16), "num_devices=16"),
])
def test_unsupported_shapes_are_xla_with_reason(kw, match):
  table = _table(_entry(4096))  # even a measured fused neighbour does not help
  dec = _choose(**kw, table=table)
  assert (dec.implementation, dec.config, dec.source) == ("xla", None, "default")
  assert match in dec.reason


def test_explicit_config_overrides():
  cfg = config_lib.Config(tile_m=64, tile_n=64)
  dec = _choose(4096, table=tuning.empty_table(), config=cfg)
  assert (dec.implementation, dec.config, dec.source) == ("fused", cfg, "override")
  dec = _choose(512, table=tuning.empty_table(), config=_BIG)
  assert (dec.implementation, dec.config) == ("xla", None)
  assert "256 rows (tile_m=128" in dec.reason  # the kernel's own reason


# ---------------------------------------------------------------------------
# Defaults and candidates: valid, within SMEM, and they lower for CUDA.
# ---------------------------------------------------------------------------

_SEED_LIKE = [(m, n, k) for n, k in ((8192, 1024), (8192, 3584), (6144, 768),
                                     (6144, 2048))
              for m in (512, 2048, 8192, 32768)]


# D = 4 and 8 in the slow layer (~12 s each on 2 CPU cores: search_space enumerates thousands of
# configs per shape); D = 1 and 2 take the same paths.
@pytest.mark.parametrize("d", [1, 2, pytest.param(4, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow)])
def test_defaults_and_candidates_valid_within_smem(d):
  for m, n, k_shard in _SEED_LIKE:
    dec = _choose(m, d=d, n=n, k_shard=k_shard, table=tuning.empty_table())
    assert dec.config is not None and dec.config.fits_smem(d), (m, n, k_shard, d)
    dec.config.check_shape(m=m, n=n, k_shard=k_shard, num_devices=d)
    cands = candidates.candidate_configs(m=m, n=n, k_shard=k_shard, num_devices=d,
                                     max_configs=6)
    assert cands[0] == dec.config
    assert len(set(cands)) == len(cands) == 6
    for c in cands:
      assert c.fits_smem(d)
      c.check_shape(m=m, n=n, k_shard=k_shard, num_devices=d)


def test_fit_smem_gives_back_the_receive_stages_a_shed_step_makes_room_for():
  # The ping-pong asked for 6 steps at D = 8: 6 do not fit even with one receive stage, 5 fit
  # with two, which it keeps (one H100: the owner's sum of a D = 8 rank at M = 2048 ~40% longer
  # with one; BUILD_NOTES 2026-12-07, 106th). Shedding stages first had left it one.
  asked = config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=6, recv_stages=2,
                            pingpong=True)
  fitted = config_lib.fit_smem(asked, 8)
  assert (fitted.max_concurrent_steps, fitted.recv_stages) == (5, 2)
  assert not dataclasses.replace(asked, recv_stages=1).fits_smem(8)
  # Depth still comes first (stages go before steps), never more stages than asked, and what
  # fits is left alone.
  deep = config_lib.fit_smem(dataclasses.replace(asked, max_concurrent_steps=5, recv_stages=3), 8)
  assert (deep.max_concurrent_steps, deep.recv_stages) == (5, 2)
  assert config_lib.fit_smem(dataclasses.replace(asked, recv_stages=1), 8).recv_stages == 1
  assert config_lib.fit_smem(fitted, 8) == fitted


def test_candidates_vary_one_field_each_first():
  cands = candidates.candidate_configs(m=8192, n=N, k_shard=K_SHARD, num_devices=1,
                                   max_configs=6)
  base = cands[0]
  changed = []
  for c in cands[1:]:
    # prefetch_tiles follows the pipeline depth (wherever it runs: config.with_prefetch).
    assert c.prefetch_tiles == c.prefetch_runs(K_SHARD), c
    diff = [f.name for f in dataclasses.fields(c)
            if getattr(c, f.name) != getattr(base, f.name) and f.name != "prefetch_tiles"]
    assert len(diff) == 1, diff
    changed.append(diff[0])
  # The default's 128 x 256 tile stacks 64 x 256 warpgroup tiles along M: no other tile_m or
  # split of it is one field away in the search space, so the tile varies through tile_n.
  # The default walks row bands 8 tiles high here (defaults._tile_order); its width has two
  # neighbours (4, then 1) before a pipeline depth comes.
  assert changed == ["tile_n", "grid_minor_dim", "grid_tile_width", "grid_tile_width",
                     "max_concurrent_steps"]
  # Deterministic and uncapped is the whole (deduplicated) search space.
  assert candidates.candidate_configs(m=8192, n=N, k_shard=K_SHARD, num_devices=1,
                                  max_configs=6) == cands


def test_spread_stores_is_searched_at_d1_only():
  # Config.spread_stores holds a whole warpgroup tile in SMEM: at D = 1 the search space has
  # it where that fits beside the pipeline; at D > 1 it is tried around a tuned config
  # (candidates.spread_variants), and the kernel refuses it with pairs or eager signals.
  d1 = [c for c in candidates.search_space(m=2048, n=6144, k_shard=768, num_devices=1)
        if c.spread_stores]
  assert d1 and all(c.fits_smem(1) and c.num_out_slots == c.sub_tiles for c in d1)
  assert {(c.cta_tile_m, c.cta_tile_n, c.max_concurrent_steps) for c in d1} >= {
      (128, 256, 3), (128, 192, 4)}
  assert not any(c.spread_stores for c in candidates.search_space(
      m=2048, n=6144, k_shard=768, num_devices=2))
  m_split = next(c for c in d1 if c.wg_dimension == config_lib.MatmulDimension.M
                 and c.tile_m == 64)  # 128-row CTA tiles: over two 64-row chunks at m = 128
  m_split.check_shape(m=2048, n=6144, k_shard=768, num_devices=2)
  for cfg, m in ((m_split, 128), (dataclasses.replace(m_split, eager_signal_steps=1), 2048)):
    with pytest.raises(NotImplementedError, match="spread_stores at D > 1"):
      cfg.check_shape(m=m, n=6144, k_shard=768, num_devices=2)


def test_adapt_config_for_loopback():
  cfg = config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=4, recv_stages=1)
  out = candidates.adapt_config(cfg, m=512, n=N, k_shard=K_SHARD, num_devices=8)
  assert out.tile_m == 64 and out.recv_stages == 2 and out.fits_smem(8)


def _export_local(cfg, m, n, k):
  sds = jax.ShapeDtypeStruct
  return jax.export.export(
      jax.jit(lambda a, b: fused.local_matmul(a, b, config=cfg)),
      platforms=["cuda"])(sds((m, k), jnp.bfloat16), sds((k, n), jnp.bfloat16))


@pytest.mark.parametrize("m,n,k_shard", [(512, 8192, 1024), (2048, 6144, 768)])
def test_default_and_first_candidates_lower_for_cuda_d1(m, n, k_shard):
  for cfg in candidates.candidate_configs(m=m, n=n, k_shard=k_shard, num_devices=1,
                                      max_configs=3):
    exp = _export_local(cfg, m, n, k_shard)
    assert "pallas_rs_local_matmul" in exp.mlir_module()


# M = 512 in the slow layer (tests/conftest.py): the same config at the same shape as
# tests/test_lowering.py's fast seed case llama70b_o_proj_m512.
@pytest.mark.parametrize("m,n,k_shard", [pytest.param(512, 8192, 1024, marks=pytest.mark.slow),
                                         (4096, 6144, 768)])
def test_default_lowers_for_cuda_d8_shard_map(m, n, k_shard):
  d = 8
  cfg = _choose(m, d=d, n=n, k_shard=k_shard, table=tuning.empty_table()).config
  mesh = jax.make_mesh((d,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  f = jax.jit(jax.shard_map(
      lambda x, w: fused.fused_matmul_reduce_scatter(x, w, axis_name="tp",
                                                     num_devices=d, config=cfg),
      mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
      out_specs=P("tp", None), check_vma=False))
  x = jax.ShapeDtypeStruct((m, k_shard * d), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(None, "tp")))
  w = jax.ShapeDtypeStruct((k_shard * d, n), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("tp", None)))
  exp = jax.export.export(f, platforms=["cuda"])(x, w)
  assert exp.out_avals[0].shape == (m, n)


# ---------------------------------------------------------------------------
# Table I/O, merge, schema.
# ---------------------------------------------------------------------------


def test_packaged_table_is_valid_and_empty():
  table = tuning.load_table(tuning.PACKAGED_TABLE_PATH)
  assert table["schema_version"] == 1
  assert isinstance(table["entries"], list)


def test_round_trip_and_merge(tmp_path):
  cfg = config_lib.Config(tile_m=64, tile_n=64, grid_minor_dim=config_lib.MatmulDimension.M,
                          grid_tile_width=4)
  old = _table(_entry(1024, cfg=cfg), _entry(4096, "xla"), _entry(4096, mode="loopback"))
  path = tmp_path / "t.json"
  tuning.save_table(path, old)
  loaded = tuning.load_table(path)
  assert tuning.config_from_json(loaded["entries"][0]["config"]) == cfg
  assert sorted(json.dumps(e, sort_keys=True) for e in loaded["entries"]) == sorted(
      json.dumps(e, sort_keys=True) for e in old["entries"])
  new = _table(_entry(4096, fused_us=(1.0,)), _entry(8192, "xla"))
  merged = tuning.merge_entries(loaded, new)
  by_key = {(e["key"]["m"], tuning.entry_mode(e)): e for e in merged["entries"]}
  assert set(by_key) == {(1024, "multi_gpu"), (4096, "multi_gpu"), (4096, "loopback"),
                         (8192, "multi_gpu")}
  assert by_key[(4096, "multi_gpu")]["implementation"] == "fused"  # replaced
  assert by_key[(4096, "loopback")] == old["entries"][2]            # kept
  assert loaded == tuning.load_table(path)  # inputs not modified


def _mutate(fn):
  table = _table(_entry(4096))
  fn(table)
  return table


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.update(schema_version=2), "schema_version=2"),
    (lambda t: t.pop("entries"), "'entries' list"),
    (lambda t: t.update(extra=1), "unknown top-level"),
    (lambda t: t["entries"][0].pop("times_us"), r"entries\[0\] is missing"),
    (lambda t: t["entries"][0].update(colour="red"), "unknown fields"),
    (lambda t: t["entries"][0]["key"].pop("dtype"), "key must have exactly"),
    (lambda t: t["entries"][0]["key"].update(m="4096"), r"key.m='4096' must be a int"),
    (lambda t: t["entries"][0]["key"].update(m=0), "must be positive"),
    (lambda t: t["entries"][0].update(implementation="triton"), "implementation='triton'"),
    (lambda t: t["entries"][0].update(config=None), "needs a config"),
    (lambda t: t["entries"][0]["config"].update(tile_m=96), "tile_m=96"),
    (lambda t: t["entries"][0]["config"].update(tile_q=1), "unknown config fields"),
    (lambda t: t["entries"][0]["config"].update(grid_minor_dim="K"), "grid_minor_dim"),
    (lambda t: t["entries"][0]["times_us"].update(xla=[1.0, float("nan")]), "finite"),
    (lambda t: t["entries"][0].update(mode="fast"), "mode='fast'"),
    (lambda t: t["entries"][0].update(mode="single_gpu"), "needs num_devices=1"),
    (lambda t: t["entries"].append(copy.deepcopy(t["entries"][0])),
     r"entries\[1\] duplicates entries\[0\]"),
])
def test_schema_errors(mutate, match):
  with pytest.raises(ValueError, match=match):
    tuning.validate_table(_mutate(mutate))


def test_load_table_errors_name_the_file(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="bad.json: not valid JSON"):
    tuning.load_table(bad)
  bad.write_text(json.dumps({"schema_version": 9, "entries": []}))
  with pytest.raises(ValueError, match="bad.json: .*schema_version=9"):
    tuning.load_table(bad)


# ---------------------------------------------------------------------------
# Overrides: env var, context manager.
# ---------------------------------------------------------------------------


def test_env_var_read_at_choose_time(tmp_path, monkeypatch):
  path = tmp_path / "mine.json"
  tuning.save_table(path, _table(_entry(4096)))
  assert _choose(4096).source == "default"  # the packaged table is empty
  monkeypatch.setenv(tuning.ENV_VAR, str(path))
  dec = _choose(4096)
  assert (dec.implementation, dec.source) == ("fused", "table")
  assert "PALLAS_RS_TUNING_TABLE" in dec.reason
  # Rewritten file: re-read (cache keyed by mtime and size).
  tuning.save_table(path, _table(_entry(4096, "xla", xla_us=(1.0, 2.0, 3.0))))
  assert _choose(4096).implementation == "xla"
  monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match="missing.json"):
    _choose(4096)


def test_use_table_is_scoped_and_nests(tmp_path, monkeypatch):
  path = tmp_path / "env.json"
  tuning.save_table(path, _table(_entry(4096, "xla")))
  monkeypatch.setenv(tuning.ENV_VAR, str(path))
  assert _choose(4096).implementation == "xla"
  with tuning.use_table(_table(_entry(4096))):
    assert _choose(4096).implementation == "fused"  # context beats env var
    with tuning.use_table(tuning.empty_table()):
      assert _choose(4096).source == "default"
    assert _choose(4096).implementation == "fused"
    # An explicit table argument beats the context.
    assert _choose(4096, table=tuning.empty_table()).source == "default"
  assert _choose(4096).implementation == "xla"
  with pytest.raises(ValueError, match="schema_version"):
    with tuning.use_table({"schema_version": 0, "entries": []}):
      pass


# ---------------------------------------------------------------------------
# api: "auto" consults the table (without running the kernel).
# ---------------------------------------------------------------------------


def _auto(m, config=None, d=8):
  """(implementation, the Config that runs, fallback reason) of "auto" on this machine."""
  dec = gate.decide("matmul_rs", m=m, k_shard=K_SHARD, n=N, dtype=jnp.bfloat16,
                    num_devices=d, implementation="auto", config=config)
  if dec.implementation == "fused":
    assert dec.config.problem == (m, K_SHARD, N, "bfloat16", d)  # a fused.CheckedConfig
  return dec.implementation, dec.config and dec.config.config, dec.fallback


def test_api_auto_consults_table(monkeypatch):
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  kind = jax.devices()[0].device_kind
  cfg = config_lib.Config(tile_m=64, tile_n=128, max_concurrent_steps=3)
  with tuning.use_table(_table(_entry(4096, cfg=cfg, gpu_kind=kind),
                               _entry(32768, "xla", gpu_kind=kind))):
    assert _auto(4096) == ("fused", cfg, None)            # exact
    assert _auto(2048) == ("fused", cfg, None)            # nearest m
    impl, config, reason = _auto(32768)
    assert (impl, config) == ("xla", None) and "tuning (table)" in reason
    impl, _, reason = _auto(4096, d=4)                    # no entry at D = 4
    assert impl == "xla" and "tuning (default)" in reason
    # Explicit config + auto: fused with it where supported (table skipped).
    mine = config_lib.Config(tile_m=128, tile_n=64)
    assert _auto(32768, config=mine) == ("fused", mine, None)
    # ... and the kernel's own NotImplementedError still falls back (32-row chunks).
    impl, _, reason = _auto(256, config=mine)
    assert impl == "xla" and "tile_m=128" in reason
  impl, _, reason = _auto(4096)                           # packaged: empty
  assert impl == "xla" and "no measurement" in reason


def test_fused_without_config_runs_the_tuned_config(monkeypatch):
  """implementation="fused" forces the kernel; with no config it takes the table's tuned one
  for the shape (also where XLA won: the best fused config measured), else the default."""
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  kind = jax.devices()[0].device_kind
  fused_cfg = config_lib.Config(tile_m=64, tile_n=128, max_concurrent_steps=3)
  xla_cfg = config_lib.Config(tile_m=128, tile_n=64, max_concurrent_steps=4)

  def forced(m, config=None):
    dec = gate.decide("matmul_rs", m=m, k_shard=K_SHARD, n=N, dtype=jnp.bfloat16,
                      num_devices=8, implementation="fused", config=config)
    return dec._replace(config=dec.config.config)  # the Config in the fused.CheckedConfig

  with tuning.use_table(_table(_entry(4096, cfg=fused_cfg, gpu_kind=kind),
                               _entry(32768, "xla", cfg=xla_cfg, gpu_kind=kind))):
    assert forced(4096) == ("fused", fused_cfg, None)
    assert forced(32768) == ("fused", xla_cfg, None)
    mine = config_lib.Config(tile_m=64, tile_n=64)
    assert forced(4096, config=mine) == ("fused", mine, None)
  default = defaults.default_config(m=4096, n=N, k_shard=K_SHARD, num_devices=8)
  with tuning.use_table(tuning.empty_table()):
    impl, config, _ = forced(4096)
  assert impl == "fused" and config == dataclasses.replace(default, num_sms=config.num_sms)


def test_api_auto_off_hopper_ignores_table(monkeypatch):
  monkeypatch.setattr(platform, "on_hopper", lambda: False)
  with tuning.use_table(_table(_entry(4096, gpu_kind=jax.devices()[0].device_kind))):
    impl, _, reason = _auto(4096)
  assert impl == "xla" and "Hopper" in reason


# ---------------------------------------------------------------------------
# The all-gather matmul's entries (op "ag_matmul") and its gate.
# ---------------------------------------------------------------------------

_AG = dict(m_shard=128, k=1024, n=1280, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
           num_devices=8, gather_dimension=0)


def _decide_ag(*, m_shard, k, n, num_devices, gather_dimension, **kw):
  """`gate.decide` for the all-gather matmul, in the kernel's terms (lhs [m_shard, k])."""
  return gate.decide("ag_matmul", m=m_shard * num_devices, k_shard=k, n=n,
                     num_devices=num_devices, dimension=gather_dimension, **kw)


def _ag_entry(implementation, *, gpu_kind, cfg=None):
  entry = _entry(_AG["m_shard"] * 8, implementation, n=_AG["n"], k_shard=_AG["k"],
                 gpu_kind=gpu_kind, cfg=None)
  entry["config"] = None if cfg is None else ag_matmul.config_to_json(cfg)
  entry["op"] = "ag_matmul"
  return entry


def test_old_entries_are_matmul_rs_and_ops_are_distinct():
  table = _table(_entry(1024))
  tuning.validate_table(table)                     # no "op": loads as before
  assert tuning.entry_op(table["entries"][0]) == "matmul_rs"
  both = _table(_entry(1024), dict(_entry(1024, "xla"), op="ag_matmul"))
  tuning.validate_table(both)                      # same key, different op: no duplicate
  with pytest.raises(ValueError, match=r"op='nccl' must be one of"):
    tuning.validate_table(_table(dict(_entry(1024), op="nccl")))
  with pytest.raises(ValueError, match=r"unknown all-gather matmul config fields .*'recv_stages'"):
    tuning.validate_table(_table(dict(_entry(1024), op="ag_matmul")))


def test_ag_config_round_trip():
  cfg = ag_matmul.default_config(128, 1280)
  assert ag_matmul.config_from_json(json.loads(json.dumps(ag_matmul.config_to_json(cfg)))) == cfg


def test_ag_auto_is_xla_unless_the_table_says_fused(monkeypatch):
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  kind = jax.devices()[0].device_kind
  choose = functools.partial(_decide_ag, **_AG, implementation="auto")
  impl, config, reason = choose(table=tuning.empty_table())
  assert (impl, config) == ("xla", None) and "tuning (default)" in reason
  assert reason.startswith("all_gather_matmul: ")
  # A matmul_rs entry of the same key does not gate the all-gather matmul.
  assert choose(table=_table(dict(_ag_entry("fused", gpu_kind=kind), op="matmul_rs",
                                  config=tuning.config_to_json(config_lib.Config())))
                )[0] == "xla"
  impl, config, _ = choose(table=_table(_ag_entry("fused", gpu_kind=kind)))
  assert impl == "fused" and config == ag_matmul.default_config(128, 1280)
  impl, _, reason = choose(table=_table(_ag_entry("xla", gpu_kind=kind)))
  assert impl == "xla" and "tuning (table)" in reason
  # Another GPU kind's measurement does not apply here.
  assert choose(table=_table(_ag_entry("fused", gpu_kind="NVIDIA B200")))[0] == "xla"
  # An explicit "fused" needs no measurement.
  assert _decide_ag(**_AG, implementation="fused", table=tuning.empty_table())[0] == "fused"


def test_autotune_writes_ag_entries_the_gate_reads(monkeypatch):
  # The entry experiments/autotune.py --op=ag_matmul writes (schema.make_entry) for the
  # row-parallel backward of a case: all_gather(dy) @ w.T, dy [m/D, n], w.T [n, k_shard].
  cfg = ag_matmul.default_config(128, 1024)
  kind = jax.devices()[0].device_kind
  entry = schema.make_entry(
      op="ag_matmul", gpu_kind=kind, num_devices=8, m=1024, n=1024, k_shard=1024,
      fused_us=[9.0, 9.5, 8.0], xla_us=[10.0, 10.5, 11.0],
      config_json=ag_matmul.config_to_json(cfg), measured_with="test", mode="multi_gpu")
  table = _table(entry)
  tuning.validate_table(table)
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  kw = dict(m_shard=128, k=1024, n=1024, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
            num_devices=8, gather_dimension=0, implementation="auto", table=table)
  assert _decide_ag(**kw)[:2] == ("fused", cfg)
  slower = schema.make_entry(
      op="ag_matmul", gpu_kind=kind, num_devices=8, m=1024, n=1024, k_shard=1024,
      fused_us=[12.0], xla_us=[10.0], config_json=None)
  assert slower["implementation"] == "xla"
  assert _decide_ag(**dict(kw, table=_table(slower)))[0] == "xla"


def test_ag_tile_variants_cover_the_shard_and_start_with_the_default():
  # Llama o_proj's backward at M = 512, D = 2: dx [512, 4096] from a 256-row shard; the
  # default 128 x 256 tiles make 32 per gathered shard for 132 SMs, the variants up to 128.
  got = candidates.ag_tile_variants(256, 8192, 4096)
  assert got[0] == ag_matmul.default_config(256, 4096)
  assert len(set(got)) == len(got) >= 5
  for cfg in got:
    assert ag_matmul.tiling_problem(cfg, m_shard=256, k=8192, n=4096) is None
  assert {(c.tile_m, c.tile_n, c.wg_dimension.name) for c in got} >= {
      (64, 128, "N"), (64, 256, "M"), (64, 64, "N")}
  # A 64-row shard (M = 512 at D = 8) takes only 64-row tiles side by side along N.
  assert all(c.tile_m == 64 and c.wg_dimension.name == "N"
             for c in candidates.ag_tile_variants(64, 8192, 1024))
  bad = dataclasses.replace(ag_matmul.default_config(256, 4096), tile_n=96)
  assert "multiple of 64" in ag_matmul.tiling_problem(bad, m_shard=256, k=8192, n=4096 - 64)


def test_autotune_dry_run_lists_the_ag_problems():
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from pathlib import Path  # pylint: disable=g-import-not-at-top
  repo = Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(repo))
  res = subprocess.run(
      [sys.executable, str(repo / "experiments" / "autotune.py"), "--dry_run",
       "--mode=multi_gpu", "--op=ag_matmul", "--names=llama70b_o_proj_m512",
       "--num_devices=2"], capture_output=True, text=True, env=env, timeout=300, check=False)
  assert res.returncode == 0, res.stderr[-2000:]
  assert "ag_matmul {'m_shard': 256, 'k': 8192, 'n': 4096}: XLA and m128n128/N" in res.stdout, (
      res.stdout)


def test_table_config_gets_the_same_checks_as_a_callers(monkeypatch):
  """A table config that this GPU cannot run (a grid larger than its SMs) is not picked: the
  gate checks table configs with fused.check_supported, as it checks a caller's."""
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  m = 4096
  table = _table(_entry(m))
  assert _choose(m, table=table).implementation == "fused"
  monkeypatch.setattr(fused, "gpu_num_sms", lambda: 114)  # e.g. an H100 PCIe
  decision = _choose(m, table=table)
  assert decision.implementation == "xla" and "114 SMs" in decision.reason, decision


def test_comm_variants_keep_the_tiles_and_vary_only_the_comm_path():
  base = config_lib.with_numerics(
      config_lib.Config(tile_m=128, tile_n=128, grid_tile_width=4), "unfused_order", 2)
  got = candidates.comm_variants(base, m=8192, n=8192, k_shard=4096, num_devices=2)
  assert [(c.comm_mode, c.comm_ctas) for c in got] == [
      ("push", 0), ("owner", 0), ("pull", 2), ("pull", 4), ("pull", 8), ("pull", 16),
      ("push", 8)]
  for c in got:
    assert (c.tile_m, c.tile_n, c.grid_tile_width, c.numerics) == (128, 128, 4, "unfused_order")
    assert c.fits_smem(2)
  # Without remote TMA loads (jax < 0.11.2 on devices) only the pushing ones.
  assert all(c.comm_mode == "push" and not c.reads_peers for c in candidates.comm_variants(
      base, m=8192, n=8192, k_shard=4096, num_devices=2, pull=False))
  # The incumbent first, when it is one of the variants too.
  p4 = dataclasses.replace(base, comm_mode="pull", comm_ctas=4)
  got = candidates.comm_variants(p4, m=8192, n=8192, k_shard=4096, num_devices=2)
  assert (got[0].comm_mode, got[0].comm_ctas) == ("pull", 4) and len(got) == 7
  # The owner's sum by TMA add carries over to every way of moving the partials but "owner"
  # (whose epilogue loads and sums them).
  added = dataclasses.replace(base, tma_add=True)
  assert all(c.tma_add == (c.comm_mode != "owner") for c in candidates.comm_variants(
      added, m=8192, n=8192, k_shard=4096, num_devices=2))
  # At D > 2 in the ring's numerics it goes with the pulling comm CTAs only (their adds in ring
  # order), whatever the incumbent's; in other numerics nowhere.
  for incumbent in (config_lib.with_numerics(base, "unfused_order", 4),
                    dataclasses.replace(config_lib.with_numerics(base, "unfused_order", 4),
                                        comm_ctas=2, comm_mode="pull", tma_add=True)):
    got = candidates.comm_variants(incumbent, m=8192, n=8192, k_shard=2048, num_devices=4)
    assert len(got) == 7 and all(
        c.tma_add == (c.comm_mode == "pull" and c.comm_ctas > 0) for c in got), got
  # With fp32 partials the same (the sum slot), with bf16 partials and the fp32 sum nowhere.
  f32 = config_lib.with_numerics(base, "fp32_partials", 4)
  got = candidates.comm_variants(f32, m=8192, n=8192, k_shard=2048, num_devices=4)
  assert got and all(c.sum_slot == (c.comm_mode == "pull" and c.comm_ctas > 0) for c in got)
  assert any(c.sum_slot for c in got)
  bf16 = config_lib.with_numerics(base, "bf16_partials", 4)
  assert not any(c.tma_add for c in candidates.comm_variants(
      bf16, m=8192, n=8192, k_shard=2048, num_devices=4))


def test_prefetch_runs_where_the_depth_divides_the_blocks():
  s3 = config_lib.Config(max_concurrent_steps=3)
  assert s3.prefetch_runs(768) and not s3.prefetch_runs(1024)  # 12 and 16 blocks of 64
  assert config_lib.Config(max_concurrent_steps=4).prefetch_runs(128)  # depth cut to 2 blocks
  with pytest.raises(NotImplementedError, match="16 k blocks .* max_concurrent_steps=3"):
    dataclasses.replace(s3, prefetch_tiles=True).check_shape(
        m=2048, n=6144, k_shard=1024, num_devices=8)
  # The default takes it wherever its depth allows, and that happens on the seed's shapes.
  seen = set()
  for d in (1, 2, 8):
    for m, n, k in ((2048, 8192, 8192), (2048, 8192, 28672), (2048, 6144, 6144),
                    (2048, 6144, 16384)):
      cfg = defaults.default_config(m=m, n=n, k_shard=k // d, num_devices=d)
      assert cfg.prefetch_tiles == cfg.prefetch_runs(k // d), (m, n, k, d, cfg)
      seen.add(cfg.prefetch_tiles)
  assert seen == {True, False}


def test_prefetch_variants_and_a_shortened_pipeline():
  base = defaults.default_config(m=2048, n=6144, k_shard=768, num_devices=2)
  off = dataclasses.replace(base, prefetch_tiles=False, max_concurrent_steps=3)
  got = candidates.prefetch_variants(off, m=2048, n=6144, k_shard=768, num_devices=2)
  # 12 blocks: the flip at 3 steps, then 4 steps (fits at D = 2); 2 steps is not tried.
  assert got == [off, dataclasses.replace(off, prefetch_tiles=True),
                 dataclasses.replace(off, prefetch_tiles=True, max_concurrent_steps=4)]
  # 64 blocks under 3 steps: no flip, 4 steps with it.
  assert candidates.prefetch_variants(off, m=2048, n=6144, k_shard=4096, num_devices=2) == [
      off, dataclasses.replace(off, prefetch_tiles=True, max_concurrent_steps=4)]
  # 7 blocks: no depth of 2-6 divides them, so the incumbent alone.
  assert candidates.prefetch_variants(off, m=2048, n=6144, k_shard=448,
                                      num_devices=2) == [off]
  # A 4-step pipeline over 16 blocks that must shorten to 3 (D > 1's receive stages) keeps
  # the config, without the prefetch.
  s4 = config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=4, prefetch_tiles=True)
  assert s4.fits_smem(1) and not s4.fits_smem(2)
  got = candidates.adapt_config(s4, m=2048, n=8192, k_shard=1024, num_devices=2)
  assert got.max_concurrent_steps == 3 and not got.prefetch_tiles


def test_owner_variants_switch_the_tma_add_where_it_can_run():
  base = config_lib.with_numerics(config_lib.Config(tile_m=128, tile_n=128), "unfused_order", 2)
  got = candidates.owner_variants(base, m=8192, n=8192, k_shard=4096, num_devices=2)
  assert [c.tma_add for c in got] == [False, True] and got[0] == base
  assert dataclasses.replace(got[1], tma_add=False) == base
  added = got[1]
  assert [c.tma_add for c in candidates.owner_variants(
      added, m=8192, n=8192, k_shard=4096, num_devices=2)] == [True, False]
  # Not at D = 4 with the direct push (no variant), but with pulling comm CTAs (the adds in
  # ring order), not in other numerics (no variant).
  ring4 = config_lib.with_numerics(base, "unfused_order", 4)
  assert candidates.owner_variants(ring4, m=8192, n=8192, k_shard=2048, num_devices=4) == [
      ring4]
  pull4 = dataclasses.replace(ring4, comm_ctas=4, comm_mode="pull")
  assert [c.tma_add for c in candidates.owner_variants(
      pull4, m=8192, n=8192, k_shard=2048, num_devices=4)] == [False, True]
  f32 = config_lib.with_numerics(base, "fp32_partials", 2)
  assert candidates.owner_variants(f32, m=8192, n=8192, k_shard=4096, num_devices=2) == [f32]
  f32_pull4 = dataclasses.replace(config_lib.with_numerics(base, "fp32_partials", 4),
                                  comm_ctas=4, comm_mode="pull")
  assert [c.sum_slot for c in candidates.owner_variants(
      f32_pull4, m=8192, n=8192, k_shard=2048, num_devices=4)] == [False, True]
  # A shape the tiles cannot take has no variants.
  assert candidates.comm_variants(base, m=8192, n=8192 + 128, k_shard=4096,
                                  num_devices=2) == []


def test_order_variants_keep_everything_but_the_tile_order():
  base = dataclasses.replace(defaults.default_config(m=32768, n=8192, k_shard=1024,
                                                       num_devices=2), comm_ctas=8,
                             comm_mode="pull")
  got = candidates.order_variants(base, m=32768, n=8192, k_shard=1024, num_devices=2)
  assert got[0] == base and len(got) == len(set(got)) >= 4
  orders = {(c.grid_minor_dim.name, c.grid_tile_width) for c in got}
  assert orders == set(candidates.ORDER_VARIANTS)  # base's order is one of them
  assert all(dataclasses.replace(c, grid_minor_dim=base.grid_minor_dim,
                                 grid_tile_width=base.grid_tile_width) == base for c in got)
  assert candidates.order_variants(base, m=32768, n=8192 + 128, k_shard=1024,
                                   num_devices=2) == []


def test_tile_variants_keep_the_comm_path_and_fill_the_sms():
  base = config_lib.with_numerics(
      dataclasses.replace(config_lib.Config(tile_m=128, tile_n=128), comm_ctas=2,
                          comm_mode="pull"), "unfused_order", 2)
  # Mixtral w2 M = 512 at D = 2: 96 CTA tiles of 128 x 256, 128 of 128 x 192.
  got = candidates.tile_variants(base, m=512, n=6144, k_shard=8192, num_devices=2)
  assert got[0] == base
  shapes_ = [(c.cta_tile_m, c.cta_tile_n, c.wg_dimension.name) for c in got]
  assert (128, 192, "M") in shapes_ and (128, 256, "M") in shapes_ and (64, 256, "N") in shapes_
  assert len(set(got)) == len(got)
  for c in got:
    assert (c.comm_mode, c.comm_ctas, c.numerics) == ("pull", 2, "unfused_order")
    c.check_shape(m=512, n=6144, k_shard=8192, num_devices=2)
  # A 64-row chunk (D = 8, M = 512) takes 128-row tiles only as pairs of chunks (warpgroups
  # along M, one chunk each), and only with the direct push.
  got = candidates.tile_variants(config_lib.Config(tile_m=64), m=512, n=8192, k_shard=1024,
                                 num_devices=8)
  assert any(c.cta_tile_m == 64 for c in got)
  assert all(c.chunk_group(512, 8) == 2 for c in got if c.cta_tile_m == 128)
  assert any(c.cta_tile_m == 128 for c in got)
  pull = dataclasses.replace(config_lib.Config(tile_m=64), comm_ctas=2, comm_mode="pull")
  assert all(c.cta_tile_m == 64 for c in candidates.tile_variants(
      pull, m=512, n=8192, k_shard=1024, num_devices=8))
  # Mixtral's n = 6144 in one wave of 64 x 384 tiles (8 chunks x 16) beside the pulling CTAs.
  got = candidates.tile_variants(pull, m=512, n=6144, k_shard=768, num_devices=8)
  assert (64, 384) in [(c.cta_tile_m, c.cta_tile_n) for c in got]
  # tma_add=True: the incumbent as it is, then its own tiles and every other with the TMA add.
  got = candidates.tile_variants(base, m=512, n=6144, k_shard=8192, num_devices=2, tma_add=True)
  assert got[0] == base and got[1] == dataclasses.replace(base, tma_add=True)
  assert all(c.tma_add for c in got[1:]) and len(got) == len(set(got))


def test_default_tiles_follow_the_wave_model():
  m_dim = config_lib.MatmulDimension.M
  cfg = lambda m, n, d: defaults.default_config(m=m, n=n, k_shard=1024, num_devices=d)
  # 128 x 256 (warpgroups along M) where it fills the SMs; 128 x 192 where 128 x 256 would
  # leave a quarter idle (Mixtral M = 512: 96 tiles); 64-row tiles for a 64-row chunk.
  assert (cfg(512, 8192, 2).cta_tile_m, cfg(512, 8192, 2).cta_tile_n) == (128, 256)
  assert cfg(512, 8192, 2).wg_dimension == m_dim
  assert (cfg(512, 6144, 2).cta_tile_m, cfg(512, 6144, 2).cta_tile_n) == (128, 192)
  assert (cfg(2048, 6144, 2).cta_tile_m, cfg(2048, 6144, 2).cta_tile_n) == (128, 256)
  # Without the TMA add (D > 2) never the M split, which has not completed over NVLink
  # (fused.nvlink_unverified): D = 8, M = 512 takes 128 x 256 CTA tiles of 128 x 128
  # warpgroup tiles side by side along N over pairs of 64-row chunks (one wave, where 64 x 256
  # tiles take two); D = 4 the N split's 128 x 256.
  for m, n, d in [(512, 8192, 8), (2048, 6144, 8), (512, 6144, 4), (8192, 8192, 4)]:
    assert cfg(m, n, d).wg_dimension == config_lib.MatmulDimension.N, (m, n, d)
  assert (cfg(512, 8192, 8).cta_tile_m, cfg(512, 8192, 8).chunk_group(512, 8)) == (128, 2)
  assert (cfg(512, 6144, 8).cta_tile_m, cfg(512, 6144, 8).chunk_group(512, 8)) == (128, 2)
  assert (cfg(8192, 8192, 4).cta_tile_m, cfg(8192, 8192, 4).cta_tile_n) == (128, 256)
  # D = 1 (no NVLink) keeps it.
  assert cfg(512, 8192, 1).wg_dimension == m_dim
  # n that no 256- or 192-column tile divides still gets a valid config.
  c = cfg(512, 320, 2)
  c.check_shape(m=512, n=320, k_shard=1024, num_devices=2)


def test_bool_fields_are_read_off_config():
  # Its own test: inside the parametrized one below, an empty BOOL_FIELDS would only skip.
  assert {"tma_add", "interleave_steps"} <= set(config_lib.BOOL_FIELDS)


@pytest.mark.parametrize("flag", config_lib.BOOL_FIELDS)
def test_config_json_round_trip_of_each_switch(flag):
  cfg = config_lib.with_numerics(config_lib.Config(tma_add=False), "unfused_order", 2)
  cfg = dataclasses.replace(cfg, **{flag: True})
  obj = json.loads(json.dumps(tuning.config_to_json(cfg)))
  assert obj[flag] is True and tuning.config_from_json(obj) == cfg
  with pytest.raises(ValueError, match=flag):
    tuning.config_from_json(dict(obj, **{flag: 1}))
  with pytest.raises(ValueError, match=flag):
    config_lib.Config(**{flag: 1})
  del obj[flag]  # Entries written before the field existed read as without it.
  assert not getattr(tuning.config_from_json(obj), flag)


def test_config_json_round_trip_names_the_dimensions():
  cfg = config_lib.Config(tile_m=64, tile_n=192, wg_dimension=config_lib.MatmulDimension.M,
                          grid_minor_dim=config_lib.MatmulDimension.M)
  obj = json.loads(json.dumps(tuning.config_to_json(cfg)))
  assert (obj["wg_dimension"], obj["grid_minor_dim"]) == ("M", "M")
  assert tuning.config_from_json(obj) == cfg
  # Entries written before the field existed read as the N split.
  del obj["wg_dimension"]
  assert tuning.config_from_json(obj).wg_dimension == config_lib.MatmulDimension.N
  with pytest.raises(ValueError, match="wg_dimension"):
    tuning.config_from_json(dict(obj, wg_dimension="K"))


def test_autotune_keeps_the_incumbent_within_the_margin():
  # experiments/autotune.py: a challenger config replaces the first candidate (the incumbent)
  # only if it is faster by more than --margin (2026-12-01: 4 pulling CTAs "won" by 0.9% in
  # 20 iterations and measured slower in the 200-iteration sweep).
  import helpers  # pylint: disable=g-import-not-at-top
  with helpers.script("autotune") as autotune:
    rec = lambda name, us, status="ok": {"name": name, "median_us": us, "status": status}
    near = [rec("incumbent", 3492.0), rec("p4", 3460.0), rec("broken", 1.0, "failed: x")]
    assert autotune._best(near, 0.02)["name"] == "incumbent"  # pylint: disable=protected-access
    assert autotune._best(near)["name"] == "p4"  # pylint: disable=protected-access
    far = [rec("incumbent", 837.0), rec("p4", 775.0)]
    assert autotune._best(far, 0.02)["name"] == "p4"  # pylint: disable=protected-access
    assert autotune._best([rec("x", 1.0, "unavailable: y")], 0.02) is None  # pylint: disable=protected-access


def test_autotune_decides_on_times_taken_together():
  # experiments/autotune.py (multi_gpu): one pass screens; XLA, the incumbent and the pass's
  # pick are timed again together, and the margin rule and fused vs XLA are decided on those
  # times alone (2026-12-04: 4 of 9 order-retune winners, 2.5-6.8% in one pass of 20, showed
  # no gain in the 200-iteration sweep; a GPU's slow phases last 0.1-0.4 s).
  import helpers  # pylint: disable=g-import-not-at-top
  with helpers.script("autotune") as autotune:
    decide = autotune._decide  # pylint: disable=protected-access

    def rec(name, times, status="ok", config=None):
      return {"label": name, "status": status, "times_us": list(times), "config": config,
              "median_us": float(np.median(times))}

    def timer(later):
      groups = []

      def time_group(records):
        groups.append([r["label"] for r in records])
        return [types.SimpleNamespace(times_us=later[r["label"]], rule=f"rule {r['label']}",
                                      median_us=float(np.median(later[r["label"]])))
                for r in records]
      return time_group, groups

    # A drift win: timed together, the challenger is as slow as the incumbent.
    xla = rec("xla", [110.0] * 3)
    recs = [rec("broken", [1.0], "failed: x"), rec("incumbent", [100.0] * 3),
            rec("lucky", [93.0] * 3), rec("slow", [120.0] * 3)]
    time_group, groups = timer({"xla": [104.0] * 4, "incumbent": [100.0] * 4,
                                "lucky": [101.0] * 4})
    best, fallback = decide(xla, recs, time_group, 0.02)
    assert best["label"] == "incumbent" and fallback is None
    assert groups == [["xla", "incumbent", "lucky"]]  # XLA first, once, all together
    assert recs[2]["pass_times_us"] == [93.0] * 3 and recs[2]["times_us"] == [101.0] * 4
    assert recs[2]["median_us"] == 101.0 and recs[2]["timing_rule"] == "rule lucky"
    assert recs[2]["pass_median_us"] == 93.0 and "pass_median_us" not in recs[3]
    # The loopback's picks rank on the pass: "lucky" (93 in the pass, 101 timed again) first,
    # the incumbent (100 both times) second; never a broken one.
    picks = autotune._loopback_picks(recs)  # pylint: disable=protected-access
    assert [r["label"] for r in picks] == ["lucky", "incumbent"]
    assert xla["times_us"] == [104.0] * 4 and "pass_times_us" not in recs[3]
    # A real win holds; the incumbent winning the pass is timed again beside XLA alone.
    recs = [rec("incumbent", [100.0] * 3), rec("fast", [90.0] * 3)]
    time_group, groups = timer({"xla": [95.0], "incumbent": [100.0], "fast": [91.0]})
    assert decide(rec("xla", [95.0]), recs, time_group, 0.02)[0]["label"] == "fast"
    recs = [rec("incumbent", [100.0] * 3), rec("near", [99.0] * 3)]
    time_group, groups = timer({"xla": [95.0], "incumbent": [97.0]})
    assert decide(rec("xla", [95.0]), recs, time_group, 0.02)[0]["label"] == "incumbent"
    assert groups == [["xla", "incumbent"]] and recs[0]["times_us"] == [97.0]
    # One pass alone (no group timer: --confirm_rounds 0), or nothing correct, times nothing
    # again.
    time_group, groups = timer({})
    recs = [rec("incumbent", [100.0] * 3), rec("lucky", [93.0] * 3)]
    assert decide(xla, recs, None, 0.02)[0]["label"] == "lucky"
    assert decide(xla, [rec("x", [1.0], "smem")], time_group, 0.02) == (None, None)
    assert not groups


def test_autotune_times_a_pulling_winners_fallback_with_it(monkeypatch):
  # A pulling config's entry keeps the fastest candidate that reads no peer as its fallback
  # (remote TMA loads need jax >= 0.11.2): it is timed in the same group, so its times compare
  # with XLA's like the winner's; without `fallbacks` (jax's all-gather matmul) there is none.
  import helpers  # pylint: disable=g-import-not-at-top
  with helpers.script("autotune") as autotune:
    monkeypatch.setattr(autotune, "_reads_peers", lambda cfg: cfg == "pull")

    def rec(name, us, config):
      return {"label": name, "status": "ok", "times_us": [us], "median_us": us,
              "config": config}

    def time_group(records):
      return [types.SimpleNamespace(times_us=[r["median_us"] + 1.0], rule="",
                                    median_us=r["median_us"] + 1.0) for r in records]
    recs = [rec("incumbent", 100.0, "push"), rec("push8", 95.0, "push"),
            rec("pull4", 80.0, "pull")]
    best, fallback = autotune._decide(  # pylint: disable=protected-access
        rec("xla", 120.0, None), recs, time_group, 0.02)
    assert best["label"] == "pull4" and fallback["label"] == "push8"
    assert fallback["times_us"] == [96.0] and fallback["pass_times_us"] == [95.0]
    recs = [rec("incumbent", 100.0, "push"), rec("pull4", 80.0, "pull")]
    best, fallback = autotune._decide(  # pylint: disable=protected-access
        rec("xla", 120.0, None), recs, time_group, 0.02, fallbacks=False)
    assert best["label"] == "pull4" and fallback is None


def test_autotune_times_a_group_in_rounds_on_its_executables():
  # `_group_timer` times the records' own executables (by record id), --confirm_rounds rounds
  # of --iterations calls each, one Timing per record in the records' order.
  import helpers  # pylint: disable=g-import-not-at-top
  with helpers.parsed_script("autotune", ["--iterations=3", "--warmup=0"]) as autotune:
    args = (jnp.ones((8, 8)),)
    recs = [{"label": "a"}, {"label": "b"}]
    compiled = {id(r): jax.jit(fn).lower(*args).compile()
                for r, fn in zip(recs, (lambda a: a + 1, lambda a: a @ a))}
    got = autotune._group_timer(compiled, args, 1, 2)(recs)  # pylint: disable=protected-access
    assert len(got) == 2 and all(len(t.times_us) == 6 for t in got)
    assert all("2 rounds" in t.rule for t in got)
    assert autotune._group_timer(compiled, args, 1, 0) is None  # pylint: disable=protected-access


def test_autotune_single_gpu_decides_like_multi_gpu(monkeypatch):
  # --mode=single_gpu (D = 1 entries) takes the same decision step: the pass screens, XLA's dot
  # and the incumbent (and the pass's pick) are timed again together on their executables, and
  # the entry's times are those. The kernel is replaced by XLA's dot here (no GPU).
  from absl import flags  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fused, "local_matmul", lambda x, w, config=None: jnp.dot(
      x, w, preferred_element_type=jnp.float32).astype(x.dtype))
  with helpers.parsed_script("autotune", ["--iterations=3", "--warmup=0", "--max_configs=2",
                                          "--noloopback", "--confirm_rounds=2"]) as autotune:
    case = shapes.custom_case(128, 256, 256, 1)
    records, entries = autotune.tune_single_gpu(case, {"device_kind": H200})
    xla, fused_recs = records[0], records[1:]
    assert xla["label"] == "xla_dot" and len(fused_recs) == 2
    assert all(r["status"] == "ok" for r in records)
    for r in (xla, fused_recs[0]):  # retimed: 2 rounds x 3 calls, the pass's 3 kept
      assert len(r["times_us"]) == 6 and len(r["pass_times_us"]) == 3
      assert "2 rounds" in r["timing_rule"]
    (entry,) = entries
    assert entry["times_us"]["xla"] == xla["times_us"]
    assert "decided on 2 x 3 iterations" in entry["measured_with"]
    flags.FLAGS.confirm_rounds = 0
    records, entries = autotune.tune_single_gpu(case, {"device_kind": H200})
    assert all("pass_times_us" not in r for r in records)
    assert "one pass of 3 iterations each decides" in entries[0]["measured_with"]


def test_autotune_stops_on_a_baseline_it_cannot_judge_against():
  # Every candidate is judged against XLA's record (its error) and its entry compares their
  # times: a baseline that did not run or has no finite error stops the case with its reason
  # (it used to be a KeyError deep in the tuner, or every candidate "wrong" on a NaN).
  import helpers  # pylint: disable=g-import-not-at-top
  with helpers.script("autotune") as autotune:
    good = {"label": "xla_seq", "status": "ok", "max_rel_error": 0.004, "times_us": [1.0]}
    assert autotune._baseline(good) is good  # pylint: disable=protected-access
    for bad, says in ((dict(good, status="smem", error="out of SMEM"), "out of SMEM"),
                      (dict(good, max_rel_error=float("nan")), "nan"),
                      ({"label": "xla_seq", "status": "not_implemented", "error": "no"}, "no")):
      with pytest.raises(RuntimeError, match=f"'xla_seq' gave no usable result.*{says}"):
        autotune._baseline(bad)  # pylint: disable=protected-access


def test_a_pull_entry_falls_back_to_its_measured_push_config(monkeypatch):
  # Pulling comm CTAs need remote TMA loads (jax >= 0.11.2 on devices); the entry's fallback,
  # measured faster than XLA in the same run, runs where they cannot.
  monkeypatch.setattr(fused, "remote_tma_loads_supported", lambda: False)
  base = defaults.default_config(m=8192, n=N, k_shard=4096, num_devices=2)
  pull = dataclasses.replace(base, comm_ctas=4, comm_mode="pull")
  entry = _entry(8192, d=2, k_shard=4096, cfg=pull)
  entry["fallback"] = {"config": tuning.config_to_json(base), "times_us": [11.0, 11.5]}
  tuning.validate_table(_table(entry))
  got = _choose(8192, d=2, k_shard=4096, table=_table(entry))
  assert (got.implementation, got.config, got.source) == ("fused", base, "table")
  assert "fallback" in got.reason and "comm_mode='pull'" in got.reason
  # Without a fallback, the same entry gates to XLA, saying why.
  del entry["fallback"]
  got = _choose(8192, d=2, k_shard=4096, table=_table(entry))
  assert got.implementation == "xla" and "comm_mode='pull'" in got.reason
  # ... also where another m's entry would run here: this shape's own run found nothing that
  # runs here beating XLA, so the nearest-m heuristic is not consulted.
  near = _entry(2048, d=2, k_shard=4096, cfg=base)
  got = _choose(8192, d=2, k_shard=4096, table=_table(entry, near))
  assert (got.implementation, got.source) == ("xla", "table"), got
  assert "no config without remote loads" in got.reason
  assert _choose(4096, d=2, k_shard=4096, table=_table(entry, near)).implementation == "fused"
  # Where pulling works, the entry's own config runs.
  monkeypatch.setattr(fused, "remote_tma_loads_supported", lambda: True)
  entry["fallback"] = {"config": tuning.config_to_json(base), "times_us": [11.0]}
  assert _choose(8192, d=2, k_shard=4096, table=_table(entry)).config == pull


def test_autotune_times_a_pulling_entrys_fallback_beside_it(monkeypatch):
  # experiments/autotune.py's tiles / owner steps keep the incumbent's comm path: where every
  # candidate pulls, the entry's fallback (a push config) is timed too, so that the new entry
  # has a fallback measured in its own run (2026-12-01: the retune had dropped them).
  from absl import flags  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  with helpers.parsed_script("autotune", []) as autotune:
    monkeypatch.setattr(platform, "device_kind", lambda: H200)
    monkeypatch.setattr(fused, "remote_tma_loads_supported", lambda: True)
    base = defaults.default_config(m=8192, n=N, k_shard=4096, num_devices=2)
    push = dataclasses.replace(base, comm_ctas=0)
    pull = dataclasses.replace(base, comm_ctas=4, comm_mode="pull")
    entry = _entry(8192, d=2, k_shard=4096, cfg=pull)
    entry["fallback"] = {"config": tuning.config_to_json(push), "times_us": [11.0]}
    shape = dict(m=8192, n=N, k_shard=4096, d=2)
    for step in ("owner", "tiles", "order", "prefetch", "spread"):
      flags.FLAGS.candidates = step  # The script's flags leave with it (forget_scripts).
      with tuning.use_table(_table(entry)):
        got = autotune.multi_gpu_candidates(**shape)
      assert got[0] == pull and got[-1] == push
      assert all(c.comm_mode == "pull" for c in got[:-1]), got
    # An entry that does not pull gets no extra candidate.
    with tuning.use_table(_table(_entry(8192, d=2, k_shard=4096, cfg=push))):
      assert all(c.comm_ctas == 0 for c in autotune.multi_gpu_candidates(**shape))


def test_fallbacks_are_measured_wins_and_validated():
  cfg = tuning.config_to_json(config_lib.Config())
  kw = dict(gpu_kind=H200, num_devices=2, m=512, n=1024, k_shard=512, fused_us=[9.0],
            xla_us=[10.0], config_json=cfg, margin=0.02)
  assert schema.make_entry(**kw, fallback=(cfg, [9.5]))["fallback"]["times_us"] == [9.5]
  assert "fallback" not in schema.make_entry(**kw, fallback=(cfg, [9.9]))  # within the margin
  assert "fallback" not in schema.make_entry(**kw)
  entry = _entry(512, d=2, k_shard=512)
  for bad, match in (([1], "fallback must be an object"),
                     ({"config": cfg}, "fields config and times_us"),
                     ({"config": cfg, "times_us": []}, "non-empty"),
                     ({"config": dict(cfg, tile_m=96), "times_us": [1.0]}, "fallback.config")):
    with pytest.raises(ValueError, match=match):
      tuning.validate_table(_table(dict(entry, fallback=bad)))


def test_shipped_pull_entries_run_a_measured_fallback_or_xla_without_remote_loads(
    monkeypatch):
  # Where pulling comm CTAs cannot run (jax < 0.11.2), each pulling entry of the shipped table
  # runs its fallback, a push config that beat XLA in the same run, or, where no such config
  # beat XLA in that run (Llama down_proj M = 8192 at D = 2, 2026-12-04), XLA.
  monkeypatch.setattr(fused, "remote_tma_loads_supported", lambda: False)
  pulls = [e for e in tuning.packaged_table()["entries"]
           if (e.get("config") or {}).get("comm_mode") == "pull"]
  assert pulls
  for e in pulls:
    k = e["key"]
    got = _choose(k["m"], d=k["num_devices"], n=k["n"], k_shard=k["k_shard"],
                  gpu_kind=k["gpu_kind"])
    fb = e.get("fallback")
    if fb is None:
      assert (got.implementation, got.source) == ("xla", "table"), (k, got)
      continue
    assert fb["config"]["comm_mode"] == "push"
    assert np.median(fb["times_us"]) < 0.98 * np.median(e["times_us"]["xla"])
    assert (got.implementation, got.source) == ("fused", "table"), (k, got)
    assert got.config == tuning.config_from_json(fb["config"]), k


def test_spread_variants():
  base = config_lib.fit_smem(config_lib.Config(tile_m=128, tile_n=128, eager_signal_steps=1), 2)
  got = candidates.spread_variants(base, m=2048, n=6144, k_shard=768, num_devices=2)
  assert got[0] == base and len(got) == 2
  assert got[1].spread_stores and got[1].eager_signal_steps == 0 and got[1].fits_smem(2)
  # Pairs (a 128-row CTA tile over two 64-row chunks): the incumbent alone.
  m_split = config_lib.fit_smem(config_lib.Config(
      tile_m=64, tile_n=256, wg_dimension=config_lib.MatmulDimension.M), 2)
  assert candidates.spread_variants(m_split, m=128, n=6144, k_shard=768,
                                    num_devices=2) == [m_split]
