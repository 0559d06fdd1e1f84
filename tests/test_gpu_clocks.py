"""experiments/gpu_clocks.py: nvidia-smi's samples parsed and summarised per GPU, and the
background sampler run against a stand-in nvidia-smi (no GPU here)."""
import pathlib
import stat
import time

import pytest

import helpers

LINE = "{gpu}, 2026/12/05 21:36:2{gpu}.879, {mhz}, {watts}, {util}, {reasons}"


def _fake_smi(tmp_path, *, old_driver=False):
  """A stand-in nvidia-smi: one sample for a query, samples until killed with -lms. With
  `old_driver` it refuses clocks_event_reasons (its older name still works). Each kind at its
  own path: gpu_clocks probes the fields once per path."""
  path = tmp_path / ("nvidia-smi-old" if old_driver else "nvidia-smi")
  busy = LINE.format(gpu=0, mhz=1575, watts=671.2, util=100, reasons="0x0000000000000004")
  idle = LINE.format(gpu=1, mhz=1980, watts=70.1, util=0, reasons="0x0000000000000001")
  refuse = 'case "$*" in *clocks_event_reasons*) exit 6;; esac\n' if old_driver else ""
  path.write_text("#!/bin/sh\n" + refuse +
                  'case "$*" in *-lms*) while true; do\n'
                  f'  echo "{busy}"; echo "{idle}"; touch "$0.sampled"; sleep 0.01; done;; esac\n'
                  f'echo "{busy}"\n')
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(path)


def _wait_for_a_sample(smi):
  """Until the stand-in has printed a sample (a busy CI host may take a while to start it);
  the caller stops it, then `_forget_samples`."""
  marker = pathlib.Path(smi + ".sampled")
  deadline = time.monotonic() + 30
  while not marker.exists():
    assert time.monotonic() < deadline, "the stand-in nvidia-smi printed nothing in 30 s"
    time.sleep(0.01)


def _forget_samples(smi):
  pathlib.Path(smi + ".sampled").unlink(missing_ok=True)


def test_parse_and_summary_per_gpu():
  with helpers.script("gpu_clocks") as gc:
    text = "\n".join([
        LINE.format(gpu=0, mhz=1965, watts=535.0, util=100, reasons="0x0000000000000004"),
        LINE.format(gpu=0, mhz=1275, watts=690.5, util=97, reasons="0x0000000000000004"),
        LINE.format(gpu=0, mhz=1980, watts=80.0, util=3, reasons="0x0000000000000001"),
        LINE.format(gpu=1, mhz=1830, watts=600.0, util=88, reasons="0x0000000000000024"),
        "1, 2026/12/05 21:36:21.000, [N/A], 600.0, 88, 0x0",  # a field the GPU did not give
        "0, 2026/12/05 21:36:2",  # the line cut by the sampler's end
    ])
    samples = gc.parse(text)
    assert [(s.gpu, s.sm_mhz) for s in samples] == [(0, 1965), (0, 1275), (0, 1980), (1, 1830)]
    got = gc.ClockLog(samples).summary()
    assert got["0"]["samples"] == 3 and got["0"]["busy_samples"] == 2  # the idle one is left out
    assert got["0"]["sm_mhz_median"] == 1620 and got["0"]["sm_mhz_min"] == 1275
    assert got["0"]["power_w_median"] == (535.0 + 690.5) / 2
    assert got["0"]["reasons"]["sw_power_cap"] == 2 and got["0"]["reasons"]["sw_thermal"] == 0
    assert got["1"]["reasons"]["sw_power_cap"] == 1 and got["1"]["reasons"]["sw_thermal"] == 1
    assert gc.busy_mhz(got) == "1620, 1830"
    assert gc.ClockLog().summary() is None and gc.busy_mhz(None) == "-"
    assert gc.busy_mhz("nvidia-smi not found") == "-"
    idle_only = gc.ClockLog(samples[2:3]).summary()
    assert idle_only == {"0": {"samples": 1, "busy_samples": 0}} and gc.busy_mhz(idle_only) == "-"


def test_sampled_reads_a_running_nvidia_smi(tmp_path):
  with helpers.script("gpu_clocks") as gc:
    for old_driver in (False, True):
      smi = _fake_smi(tmp_path, old_driver=old_driver)
      with gc.sampled(period_ms=10, smi=smi) as log:
        assert not log.samples  # filled when the block ends
        _wait_for_a_sample(smi)
      _forget_samples(smi)
      assert log.note is None and log.samples, (old_driver, log)
      got = log.summary()
      assert got["0"]["sm_mhz_median"] == 1575 and got["0"]["reasons"]["sw_power_cap"] > 0
      assert got["1"]["busy_samples"] == 0


def test_sampled_says_why_it_has_nothing(tmp_path):
  with helpers.script("gpu_clocks") as gc:
    with gc.sampled(smi=str(tmp_path / "no-such-smi")) as log:
      pass
    assert log.samples == [] and log.note.endswith("not found") and log.summary() is None
    refusing = tmp_path / "refusing-smi"
    refusing.write_text("#!/bin/sh\nexit 6\n")
    refusing.chmod(refusing.stat().st_mode | stat.S_IXUSR)
    with gc.sampled(smi=str(refusing)) as log:
      pass
    assert log.note.endswith("refused the clock query") and log.summary() is None


def test_a_sampler_restarts_for_each_block_and_its_records_get_the_clock(tmp_path):
  # matmul_rs_bench gives each shape's records the clock seen since the previous shape.
  with helpers.script("gpu_clocks") as gc:
    smi = _fake_smi(tmp_path)
    sampler = gc.Sampler(period_ms=10, smi=smi)
    sampler.start()
    with pytest.raises(RuntimeError, match="already running"):
      sampler.start()
    for _ in range(2):
      _wait_for_a_sample(smi)
      records = [{"implementation": "fused"}, {"implementation": "xla"}]
      gc.attach(records, sampler)
      _forget_samples(smi)
      assert records[0]["clocks"] is records[1]["clocks"]
      assert records[0]["clocks"]["0"]["sm_mhz_median"] == 1575
    _wait_for_a_sample(smi)
    assert sampler.stop().samples  # running again after the last attach
    assert sampler.stop().note == "the sampler was not started"
    records = [{}]
    gc.attach(records, None)  # smoke mode: nothing sampled, nothing attached
    assert records == [{}]
    missing = gc.Sampler(smi=str(tmp_path / "absent"))
    missing.start()
    assert missing.stop().note.endswith("not found")
