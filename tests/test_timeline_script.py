"""experiments/timeline.py's trace summary and profiler sizing on CPU (the profiled kernel
itself runs only on GPUs: Mosaic GPU's profiler dumps its trace through a host callback)."""
import dataclasses

from absl import app
import pytest

import helpers
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import fused


@pytest.fixture(scope="module")
def timeline():
  yield helpers.load_script("timeline")
  helpers.forget_scripts("timeline")  # Its absl flags share names with other scripts'.


def _ev(name, ph, ts, tid):
  return {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}


def test_summary_of_a_two_warpgroup_trace(timeline):
  # Mosaic GPU profiler events (fused.profile): two tiles on warpgroup 1, one on 2; the own
  # epilogue nests an owner_wait; times in us from the first event.
  events = [
      _ev("mainloop", "B", 100.0, 1), _ev("mainloop", "E", 110.0, 1),
      _ev("remote_epilogue", "B", 110.0, 1), _ev("remote_epilogue", "E", 112.0, 1),
      _ev("mainloop", "B", 112.0, 1), _ev("mainloop", "E", 122.0, 1),
      _ev("own_epilogue", "B", 122.0, 1), _ev("owner_wait", "B", 122.5, 1),
      _ev("owner_wait", "E", 125.0, 1), _ev("own_epilogue", "E", 127.0, 1),
      _ev("mainloop", "B", 101.0, 2), _ev("mainloop", "E", 113.0, 2),
      _ev("own_epilogue", "B", 113.0, 2),  # never closed: counted, not summed
  ]
  s = timeline.summarize(events)
  assert s["phases"]["mainloop"] == {"count": 3, "median_us": 10.0, "max_us": 12.0,
                                     "total_us": 32.0}
  assert s["phases"]["owner_wait"]["median_us"] == 2.5
  assert s["phases"]["own_epilogue"]["count"] == 1
  assert s["landmarks"] == {"first_mainloop_start_us": 0.0, "last_mainloop_end_us": 22.0,
                            "last_own_epilogue_end_us": 27.0, "trace_end_us": 27.0,
                            "tail_us": 5.0}
  assert (s["warpgroups"], s["unclosed"]) == (2, 1)
  with pytest.raises(ValueError, match="empty"):
    timeline.summarize([])


def test_each_calls_trace_is_kept_under_its_own_name(timeline, tmp_path):
  # jax dumps every call of a compiled kernel to one name and never overwrites it: moving the
  # file after each call is what lets the next call's trace be written.
  dumped = tmp_path / "pallas_rs_matmul_rs-17-trace.json"
  for call in range(3):
    dumped.write_text(f"call {call}")
    kept = timeline.keep_call_traces(tmp_path, call)
    assert [p.name for p in kept] == [f"call{call:03d}-pallas_rs_matmul_rs-17-trace.json"]
    assert kept[0].read_text() == f"call {call}" and not dumped.exists()
  assert timeline.keep_call_traces(tmp_path, 3) == []  # nothing new dumped: nothing claimed
  assert len(list(tmp_path.glob("call*-trace.json"))) == 3


def test_profiled_config_leaves_the_profiler_its_shared_memory(timeline):
  cfg = config_lib.with_numerics(config_lib.Config(), "unfused_order", 2)
  # 512 events per warpgroup take 24 KB, more than the default pipeline leaves.
  assert not cfg.fits_smem(2, limit=config_lib.SMEM_LIMIT_BYTES - fused.profile_smem_bytes(512))
  got = timeline.fit_for_profile(cfg, space=512, num_devices=2, tiles_per_cta=2)
  assert got.max_concurrent_steps < cfg.max_concurrent_steps
  assert dataclasses.replace(got, max_concurrent_steps=cfg.max_concurrent_steps) == cfg
  assert got.smem_bytes(2) + fused.profile_smem_bytes(512) <= config_lib.SMEM_LIMIT_BYTES
  assert timeline.fit_for_profile(cfg, space=128, num_devices=2, tiles_per_cta=2) == cfg
  with pytest.raises(app.UsageError, match="undefined behaviour"):
    timeline.fit_for_profile(cfg, space=128, num_devices=2, tiles_per_cta=64)


def test_profile_context_sets_and_restores_the_compiler_params():
  assert "profile_space" not in fused._compiler_params().__dict__ or (  # pylint: disable=protected-access
      fused._compiler_params().profile_space == 0)  # pylint: disable=protected-access
  with fused.profile("/tmp/x", 64):
    params = fused._compiler_params()  # pylint: disable=protected-access
    assert (params.profile_space, params.profile_dir) == (64, "/tmp/x")
  assert fused._compiler_params().profile_space == 0  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="space"):
    with fused.profile("/tmp/x", 0):
      pass
