"""pallas_rs.tuning.metrics arithmetic and pallas_rs.bench.timing statistics and rules (CPU)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_rs.tuning import metrics
from pallas_rs.bench import cupti
from pallas_rs.bench import timing


# --- overlap figures ---------------------------------------------------------


def test_overlap_efficiency_worked_example():
  # T_gemm 10, T_comm 20: sequential 30, ideal 20; fused 21 hides 9 of 10.
  assert metrics.overlap_efficiency(10.0, 20.0, 21.0) == pytest.approx(0.9)
  assert metrics.comm_hidden_fraction(10.0, 20.0, 21.0) == pytest.approx(0.45)
  assert metrics.fused_over_ideal(10.0, 20.0, 21.0) == pytest.approx(1.05)
  assert metrics.speedup(30.0, 21.0) == pytest.approx(30 / 21)


def test_overlap_efficiency_bounds():
  assert metrics.overlap_efficiency(10.0, 20.0, 30.0) == 0.0  # sequential
  assert metrics.overlap_efficiency(10.0, 20.0, 20.0) == 1.0  # perfect
  # Symmetric in gemm/comm: the min is the denominator.
  assert metrics.overlap_efficiency(20.0, 10.0, 21.0) == pytest.approx(0.9)


def test_overlap_efficiency_equal_gemm_and_comm():
  assert metrics.overlap_efficiency(5.0, 5.0, 5.0) == 1.0
  assert metrics.overlap_efficiency(5.0, 5.0, 7.5) == 0.5
  assert metrics.comm_hidden_fraction(5.0, 5.0, 7.5) == 0.5
  assert metrics.fused_over_ideal(5.0, 5.0, 7.5) == 1.5


def test_fused_slower_than_sequential_gives_negative_e():
  e = metrics.overlap_efficiency(10.0, 20.0, 40.0)
  assert e == pytest.approx(-1.0)
  assert metrics.speedup(30.0, 40.0) == pytest.approx(0.75)
  assert metrics.comm_hidden_fraction(10.0, 20.0, 40.0) == pytest.approx(-0.5)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, None, "1"])
def test_overlap_rejects_bad_times(bad):
  with pytest.raises(ValueError, match="must be"):
    metrics.overlap_efficiency(bad, 1.0, 1.0)
  with pytest.raises(ValueError, match="t_fused"):
    metrics.overlap_efficiency(1.0, 1.0, bad)
  with pytest.raises(ValueError, match="t_seq"):
    metrics.speedup(bad, 1.0)


def test_overlap_metrics_dict():
  out = metrics.overlap_metrics(t_gemm=10.0, t_comm=20.0, t_seq=30.0,
                                t_fused=21.0)
  assert out["overlap_efficiency"] == pytest.approx(0.9)
  assert out["speedup_vs_seq"] == pytest.approx(30 / 21)
  assert out["t_ideal"] == 20.0
  assert out["gemm_over_comm"] == 0.5


# --- work, traffic, rates, estimates -----------------------------------------


def test_flops_and_bytes():
  assert metrics.gemm_flops(512, 1024, 8192) == 2 * 512 * 1024 * 8192
  # NCCL busbw: (D - 1) / D of the per-device [m, n] input.
  assert metrics.reduce_scatter_bus_bytes(512, 8192, 8, 2) == (
      7 / 8 * 512 * 8192 * 2)
  assert metrics.reduce_scatter_bus_bytes(512, 8192, 1, 2) == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(m=0, k_shard=1, n=1), "m=0"),
    (dict(m=1, k_shard=-4, n=1), "k_shard=-4"),
    (dict(m=1, k_shard=1, n=1.5), "n=1.5"),
])
def test_flops_rejects_bad_dims(kwargs, match):
  with pytest.raises(ValueError, match=match):
    metrics.gemm_flops(**kwargs)


def test_rates():
  assert metrics.achieved_tflops(2e12, 0.5) == pytest.approx(4.0)
  assert metrics.achieved_gbps(3e9, 2.0) == pytest.approx(1.5)
  assert metrics.achieved_gbps(0.0, 1.0) == 0.0
  with pytest.raises(ValueError, match="seconds"):
    metrics.achieved_tflops(1.0, 0.0)
  with pytest.raises(ValueError, match="seconds"):
    metrics.achieved_gbps(1.0, math.nan)
  with pytest.raises(ValueError, match="flops"):
    metrics.achieved_tflops(math.nan, 1.0)


def test_estimates_match_design_table():
  # docs/design.md section 2: o_proj M=512 T_comm est. 23.6 us at 311 GB/s.
  t_comm = metrics.estimate_t_comm(512, 8192, 8, 2)
  assert t_comm * 1e6 == pytest.approx(23.6, abs=0.05)
  # o_proj M=32768: 1510 us.
  assert metrics.estimate_t_comm(32768, 8192, 8) * 1e6 == pytest.approx(
      1510, rel=2e-3)
  t_gemm = metrics.estimate_t_gemm(512, 1024, 8192)
  assert t_gemm == pytest.approx(2 * 512 * 1024 * 8192 / 790e12)
  est = metrics.roofline_estimates(512, 1024, 8192, 8)
  assert "estimate" in est["label"]
  assert est["t_ideal_us"] == max(est["t_gemm_us"], est["t_comm_us"])
  with pytest.raises(ValueError, match="peak_flops"):
    metrics.estimate_t_gemm(1, 1, 1, peak_flops=0.0)


# --- statistics ----------------------------------------------------------------


def test_summarize():
  stats = metrics.summarize([float(i) for i in range(1, 101)])
  assert stats["count"] == 100
  assert stats["median"] == 50.5
  assert stats["min"] == 1.0 and stats["max"] == 100.0
  assert stats["p90"] == pytest.approx(np.percentile(np.arange(1, 101), 90))
  assert stats["p95"] == pytest.approx(95.05)


@pytest.mark.parametrize("bad", [[], [1.0, math.nan], [1.0, -2.0], [math.inf]])
def test_summarize_rejects(bad):
  with pytest.raises(ValueError, match="times"):
    metrics.summarize(bad)


# --- timing: the multi-device CUPTI rule (synthetic records) -------------------


def test_kernels_to_timing_one_device():
  per_iter = [[("gemm", 0.010), ("cast", 0.002)], [("gemm", 0.012),
                                                    ("cast", 0.002)]]
  t = timing.kernels_to_timing(per_iter, num_devices=1)
  assert t.timer == "cupti"
  assert t.times_us == pytest.approx([12.0, 14.0])
  assert t.times_min_us == pytest.approx([12.0, 14.0])
  assert t.kernels["gemm"]["count_per_iteration"] == 1


def test_kernels_to_timing_max_and_min_rule():
  # Two devices, two kernels each; records interleaved without device ids.
  it = [("dot", 0.010), ("rs", 0.030), ("dot", 0.012), ("rs", 0.020)]
  t = timing.kernels_to_timing([it, it], num_devices=2)
  # step = max(dot) + max(rs); min rule = min(dot) + min(rs).
  assert t.times_us == pytest.approx([42.0, 42.0])
  assert t.times_min_us == pytest.approx([30.0, 30.0])
  assert "largest" in t.rule
  assert any("upper bound" in n for n in t.notes)


def test_kernels_to_timing_repeated_kernel_per_device():
  # Each device launches "step" twice per iteration (c = 2).
  it = [("step", 0.001), ("step", 0.004), ("step", 0.002), ("step", 0.003)]
  t = timing.kernels_to_timing([it], num_devices=2)
  assert t.times_us == pytest.approx([7.0])  # 4 + 3
  assert t.times_min_us == pytest.approx([3.0])  # 1 + 2


def test_kernels_to_timing_not_separable_uses_mean():
  it = [("a", 0.010), ("b", 0.020), ("a", 0.010)]
  t = timing.kernels_to_timing([it], num_devices=2)
  assert t.times_us == pytest.approx([20.0])  # 40 us over 2 devices
  assert t.times_min_us is None
  assert "mean" in t.rule


def test_kernel_split_separates_the_main_kernel_from_what_else_a_call_launches():
  # As an H100 recorded a D = 8 rank's call (BUILD_NOTES 2026-12-07, 106th): jax's zero-fill
  # of the semaphores, then the Mosaic kernel; two devices pool their records.
  per_iter = [[("loop_broadcast_fusion", 0.0009), ("pallas_rs_x_mosaic_gpu_kernel", 0.0095)],
              [("loop_broadcast_fusion", 0.0009), ("pallas_rs_x_mosaic_gpu_kernel", 0.0097)]]
  t = timing.kernels_to_timing(per_iter, num_devices=1)
  assert timing.kernel_split_us(t.kernels, "mosaic_gpu") == pytest.approx((9.6, 0.9))
  two = timing.kernels_to_timing([per_iter[0] * 2], num_devices=2)
  assert timing.kernel_split_us(two.kernels, "mosaic_gpu", 2) == pytest.approx((9.5, 0.9))
  assert timing.kernel_split_us(t.kernels, "nvjet") == pytest.approx((0.0, 10.5))
  with pytest.raises(ValueError, match="num_devices"):
    timing.kernel_split_us(t.kernels, "mosaic_gpu", 0)


class _FakeProfiler:
  """Stands in for jax.experimental.mosaic.gpu.profiler on CPU."""

  def __init__(self, fail_chunking=False):
    self.fail_chunking = fail_chunking
    self.calls = []

  def measure(self, f, *, aggregate=True, iterations=1):
    assert aggregate is False
    self.calls.append(iterations)

    def wrapper(*args):
      out = f(*args)
      if iterations > 1 and self.fail_chunking:
        raise RuntimeError("Kernel names are not consistent across iterations")
      one = [("k0", 0.005), ("k0", 0.007)]  # two devices
      return out, one if iterations == 1 else [one] * iterations
    return wrapper


@pytest.mark.parametrize("fail_chunking", [False, True])
def test_cupti_path_with_fake_profiler(monkeypatch, fail_chunking):
  fake = _FakeProfiler(fail_chunking)
  monkeypatch.setattr(cupti, "_measure_params", lambda: (
      fake, {"f": None, "aggregate": None, "iterations": None}))
  f = jax.jit(lambda a: a * 2)
  t = timing.time_function(f, (jnp.ones(4),), iterations=3, warmup=1,
                           timer="cupti", num_devices=2)
  assert t.timer == "cupti"
  assert t.times_us == pytest.approx([7.0] * 3)
  assert t.times_min_us == pytest.approx([5.0] * 3)
  assert t.compile_s is not None and t.host_batch_us > 0
  if fail_chunking:
    assert fake.calls == [3, 1, 1, 1]
    assert any("one CUPTI session per iteration" in n for n in t.notes)
  else:
    assert fake.calls == [3]
  js = t.to_json()
  assert js["stats"]["median"] == pytest.approx(7.0)
  assert js["stats_min_across_devices"]["median"] == pytest.approx(5.0)


# --- timing: CUPTI's record order across devices --------------------------------


def test_classify_layout():
  s, c = "loop_sine_fusion", "loop_cosine_fusion"
  assert cupti.classify_layout([s] * 8 + [c] * 8, 8) == cupti.DEVICE_MAJOR
  # D = 3 with device 0's run between the others'.
  assert cupti.classify_layout([c] * 8 + [s] * 8 + [c] * 8, 8) == cupti.DEVICE_MAJOR
  assert cupti.classify_layout([s, c] * 8, 8) == cupti.INTERLEAVED
  assert cupti.classify_layout([s, s, c, c] * 4, 8) == cupti.INTERLEAVED
  assert cupti.classify_layout([s] * 16, 8) == cupti.UNKNOWN
  assert cupti.classify_layout([], 8) == cupti.UNKNOWN


def _device_major(per_device_us, names=("gemm", "cast")):
  """One session's records as CUPTI hands them over: device 0's iterations, then device 1's;
  each iteration's time split over `names` (the last kernel takes 1 us)."""
  return [rec for dev in per_device_us for t in dev
          for rec in ((names[0], (t - 1.0) / 1e3), (names[1], 1.0 / 1e3))]


def test_pair_devices_regroups_device_major_records():
  flat = _device_major([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]])
  paired = cupti.pair_devices(flat, num_devices=2, iterations=3)
  assert [[round(ms * 1e3, 6) for _, ms in it] for it in paired] == [
      [9.0, 1.0, 19.0, 1.0], [10.0, 1.0, 20.0, 1.0], [11.0, 1.0, 21.0, 1.0]]
  assert cupti.pair_devices(flat, num_devices=2, iterations=4) is None
  assert cupti.pair_devices(flat[:-1], num_devices=2, iterations=3) is None
  swapped = flat[:2] + [flat[3], flat[2]] + flat[4:]  # a run whose names differ
  assert cupti.pair_devices(swapped, num_devices=2, iterations=3) is None
  # More records per device than one activity buffer surely holds: not paired.
  assert cupti.pair_devices(_device_major([[10.0] * 5001, [20.0] * 5001]), num_devices=2,
                            iterations=5001) is None
  assert cupti.pair_devices(_device_major([[10.0] * 5000, [20.0] * 5000]), num_devices=2,
                            iterations=5000) is not None


class _DeviceMajorProfiler:
  """profiler.measure as it behaves on the GPU hosts: the session's records device by device,
  then split into `iterations` equal chunks (so a chunk holds consecutive iterations of one
  device)."""

  def __init__(self, per_device_us):
    self.flat = _device_major(per_device_us)

  def measure(self, f, *, aggregate=True, iterations=1):
    def wrapper(*args):
      k = len(self.flat) // iterations
      return f(*args), [self.flat[i * k:(i + 1) * k] for i in range(iterations)]
    return wrapper


def test_device_major_records_time_the_slowest_device(monkeypatch):
  # Device 1 is 2 us slower every iteration and both drift upwards. The legacy rule takes a
  # chunk (two consecutive iterations of one device) for one iteration of both devices: its
  # first half is device 0's times, its second half device 1's.
  dev0 = [100.0 + i for i in range(6)]
  dev1 = [102.0 + i for i in range(6)]
  fake = _DeviceMajorProfiler([dev0, dev1])
  monkeypatch.setattr(cupti, "_measure_params", lambda: (fake, {"iterations": None}))
  f = jax.jit(lambda a: a * 2)
  args = (jnp.ones(4),)
  monkeypatch.setattr(cupti, "record_layout", lambda: cupti.DEVICE_MAJOR)
  t = timing.time_function(f, args, iterations=6, warmup=0, timer="cupti", num_devices=2)
  assert t.times_us == pytest.approx(dev1)
  assert t.times_min_us == pytest.approx(dev0)
  assert t.device_times_us == [pytest.approx(dev0), pytest.approx(dev1)]
  assert t.to_json()["device_medians_us"] == pytest.approx([102.5, 104.5])
  assert "paired with devices" in t.rule
  monkeypatch.setattr(cupti, "record_layout", lambda: cupti.INTERLEAVED)
  legacy = timing.time_function(f, args, iterations=6, warmup=0, timer="cupti", num_devices=2)
  assert legacy.times_us == pytest.approx([101.0, 103.0, 105.0, 103.0, 105.0, 107.0])
  assert "legacy rule" in legacy.rule
  assert any("interleaved" in n for n in legacy.notes)
  assert legacy.device_times_us is None and legacy.to_json()["device_medians_us"] is None


def test_device_major_records_per_session_fallback(monkeypatch):
  # One session per iteration (the chunking fallback): each session is device 0's kernels,
  # then device 1's.
  class PerSession:
    def __init__(self):
      self.i = 0

    def measure(self, f, *, aggregate=True, iterations=1):
      def wrapper(*args):
        if iterations > 1:
          raise RuntimeError("Kernel names are not consistent across iterations")
        self.i += 1
        return f(*args), _device_major([[10.0 * self.i], [10.0 * self.i + 3.0]])
      return wrapper

  monkeypatch.setattr(cupti, "_measure_params", lambda: (PerSession(), {"iterations": None}))
  monkeypatch.setattr(cupti, "record_layout", lambda: cupti.DEVICE_MAJOR)
  t = timing.time_function(jax.jit(lambda a: a + 1), (jnp.ones(2),), iterations=3, warmup=0,
                           timer="cupti", num_devices=2)
  assert t.times_us == pytest.approx([13.0, 23.0, 33.0])
  assert t.times_min_us == pytest.approx([10.0, 20.0, 30.0])
  assert any("one CUPTI session per iteration" in n for n in t.notes)


def test_record_layout_without_gpus_is_unknown():
  assert cupti.record_layout() == cupti.UNKNOWN


def test_cupti_sessions_bound_the_outputs_in_flight(monkeypatch):
  # profiler.measure holds every call's outputs until its session ends: a function whose
  # outputs would not fit is timed in several sessions (16 B of output, 32 B allowed: 2 calls).
  fake = _FakeProfiler()
  monkeypatch.setattr(cupti, "_measure_params", lambda: (
      fake, {"f": None, "aggregate": None, "iterations": None}))
  monkeypatch.setattr(timing, "MAX_OUTPUT_BYTES_IN_FLIGHT", 32)
  t = timing.time_function(jax.jit(lambda a: a * 2), (jnp.ones(4, jnp.float32),),
                           iterations=5, warmup=0, timer="cupti", num_devices=2)
  assert fake.calls == [2, 2, 1]
  assert t.iterations == 5 and t.times_us == pytest.approx([7.0] * 5)
  assert any("3 CUPTI sessions of <= 2 calls" in n for n in t.notes)
  assert timing._session_sizes(200, None) == [200]  # pylint: disable=protected-access
  assert timing._session_sizes(200, 60) == [50, 50, 50, 50]  # pylint: disable=protected-access
  assert timing._session_sizes(7, 3) == [3, 2, 2]  # pylint: disable=protected-access


def test_cupti_other_runtime_errors_propagate(monkeypatch):
  class Broken(_FakeProfiler):
    def measure(self, f, *, aggregate=True, iterations=1):
      def wrapper(*args):
        raise RuntimeError("CUPTI profiling is not supported on this platform")
      return wrapper
  monkeypatch.setattr(cupti, "_measure_params",
                      lambda: (Broken(), {"iterations": None}))
  with pytest.raises(RuntimeError, match="not supported"):
    timing.time_function(jax.jit(lambda a: a + 1), (jnp.ones(2),),
                         iterations=2, warmup=0, timer="cupti")


# --- timing: host wall clock on CPU ------------------------------------------


def test_host_wall_clock_on_cpu():
  assert timing.resolve_timer("auto") == "host_wall_clock"
  f = jax.jit(lambda a, b: a @ b)
  a = jnp.ones((32, 32))
  t = timing.time_function(f, (a, a), iterations=5, warmup=2)
  assert t.timer == "host_wall_clock"
  assert len(t.times_us) == 5 and all(x > 0 for x in t.times_us)
  assert t.iterations == 5 and t.warmup == 2
  assert t.compile_s > 0 and t.host_batch_us is None
  assert "no performance claims" in t.rule
  assert t.to_json()["stats"]["count"] == 5


@pytest.mark.parametrize("kwargs, match", [
    (dict(iterations=0), "iterations=0"),
    (dict(warmup=-1), "warmup=-1"),
    (dict(num_devices=0), "num_devices=0"),
    (dict(timer="events"), "timer='events'"),
])
def test_time_function_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    timing.time_function(jax.jit(lambda a: a), (jnp.ones(2),), **kwargs)


def test_probe_layout_off_gpu_is_unknown():
  # No Mosaic GPU CUPTI session on CPU: the probe says it cannot tell (the legacy rule runs).
  assert cupti.probe_layout(jax.devices()[:2]) == cupti.UNKNOWN


def test_overlap_interval_resamples_rounds_together():
  # Two rounds; in the second every function runs 1.5x slower (a slow phase). Resampled
  # round by round together, E stays what both rounds give alone: a point interval.
  gemm = [100.0] * 4 + [150.0] * 4
  comm = [50.0] * 4 + [75.0] * 4
  fused = [110.0] * 4 + [165.0] * 4
  lo, hi = metrics.overlap_interval(gemm, comm, fused, rounds=2)
  assert lo == pytest.approx(0.8) and hi == pytest.approx(0.8)
  # The fused path alone drifts between rounds: the interval spans both rounds' E.
  fused = [110.0] * 4 + [120.0] * 4
  lo, hi = metrics.overlap_interval([100.0] * 8, [50.0] * 8, fused, rounds=2)
  assert lo == pytest.approx(0.6) and hi == pytest.approx(0.8)
  assert metrics.overlap_interval(gemm, comm, fused, rounds=1) is None
  assert metrics.overlap_interval(gemm, comm[:-1], fused, rounds=2) is None
