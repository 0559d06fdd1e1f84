"""pallas_rs.bench.alternating: functions timed in turn, in rounds or call by call (CPU; the
CUPTI sessions faked as CUPTI hands them over on the GPU hosts: device by device)."""
import jax
import jax.numpy as jnp
import pytest

from pallas_rs.bench import alternating
from pallas_rs.bench import cupti
from pallas_rs.bench import timing


def test_merge_rounds():
  a = timing.kernels_to_timing([[("k", 0.010), ("k", 0.012)]] * 2, 2, paired=True)
  b = timing.kernels_to_timing([[("k", 0.020), ("k", 0.014)]], 2, paired=True)
  a.host_batch_us, b.host_batch_us = 10.0, 40.0
  a.notes.append("only in a")
  t = alternating.merge_rounds([a, b])
  assert t.times_us == pytest.approx([12.0, 12.0, 20.0])
  assert t.times_min_us == pytest.approx([10.0, 10.0, 14.0])
  assert t.device_times_us == [pytest.approx([10.0, 10.0, 20.0]), pytest.approx([12.0, 12.0, 14.0])]
  assert t.iterations == 3 and t.host_batch_us == pytest.approx(20.0)
  assert t.kernels["k"]["max_us"] == pytest.approx(20.0)
  assert "2 rounds" in t.rule and t.notes.count("only in a") == 1
  assert alternating.merge_rounds([a]).rule == a.rule
  with pytest.raises(ValueError, match="no rounds"):
    alternating.merge_rounds([])


def test_time_alternating_order_and_errors(monkeypatch):
  # The functions take turns within each round; one that fails is reported once and dropped.
  calls = []

  def time_function(fn, args, *, iterations, warmup, timer, num_devices):
    calls.append((fn, iterations, warmup))
    assert num_devices == (4 if fn == "good" else 1)  # the item's own, else the default
    if fn == "bad" and len(calls) > 2:
      raise RuntimeError("lost the GPU")
    return timing.Timing(timer="host_wall_clock", times_us=[float(len(calls))] * iterations,
                         times_min_us=None, rule="fake", iterations=iterations, warmup=warmup)

  monkeypatch.setattr(timing, "time_function", time_function)
  errors = []
  got = alternating.time_alternating({"a": ("good", (), 4), "b": ("bad", ())}, iterations=5,
                                     rounds=3, warmup=2,
                                     on_error=lambda key, e: errors.append((key, str(e))))
  assert calls == [("good", 2, 2), ("bad", 2, 2), ("good", 2, 0), ("bad", 2, 0), ("good", 1, 0)]
  assert errors == [("b", "lost the GPU")] and set(got) == {"a"}
  assert got["a"].times_us == [1.0, 1.0, 3.0, 3.0, 5.0]
  calls.clear()
  with pytest.raises(RuntimeError, match="lost the GPU"):
    alternating.time_alternating({"b": ("bad", ())}, iterations=6, rounds=3)


def test_split_cycles_regroups_calls_device_by_device():
  # Two devices, two iterations of a cycle: function a (kernels g, c), then b (kernel n).
  names = [["g", "c"], ["n"]]
  records = [(name, float(d * 100 + i * 10 + j)) for d in range(2) for i in range(2)
             for j, name in enumerate(["g", "c", "n"])]
  got = cupti.split_cycles(records, names, iterations=2, num_devices=2)
  assert got[0] == [[("g", 0.0), ("c", 1.0), ("g", 100.0), ("c", 101.0)],
                    [("g", 10.0), ("c", 11.0), ("g", 110.0), ("c", 111.0)]]
  assert got[1] == [[("n", 2.0), ("n", 102.0)], [("n", 12.0), ("n", 112.0)]]
  assert cupti.split_cycles(records[:-1], names, 2, 2) is None
  assert cupti.split_cycles(records, names, 3, 2) is None
  assert cupti.split_cycles(records[1:] + records[:1], names, 2, 2) is None  # out of cycle
  assert cupti.split_cycles([], [[]], 1, 1) is None


class _FakeExtension:
  """The Mosaic GPU extension's CUPTI session: what the fake functions run between init and
  get, handed over device by device."""

  def __init__(self):
    self.log, self.on, self.calls = None, False, 0

  def _cupti_init(self):
    self.log, self.on = [[], []], True

  def _cupti_get_timings(self, finalize):
    assert finalize
    self.on = False
    return [r for device in self.log for r in device]


class _FakeFunction:
  """A compiled function on two devices: kernels `names`, device 1 `skew` us slower; every
  call in a slow phase (calls 6 to 13 of all the functions' calls) takes twice as long."""

  def __init__(self, ext, names, us, skew=0.0):
    self.ext, self.names, self.us, self.skew = ext, names, us, skew

  def lower(self, *args):
    del args
    return self

  def compile(self):
    return self

  def __call__(self, *args):
    if self.ext.on:
      self.ext.calls += 1
      slow = 2.0 if 6 <= self.ext.calls < 14 else 1.0
      for d in range(2):
        self.ext.log[d] += [(n, (self.us + d * self.skew) * slow / len(self.names) / 1e3)
                            for n in self.names]
    return jnp.zeros(1)


def _fake_session(monkeypatch, layout=cupti.DEVICE_MAJOR):
  ext = _FakeExtension()
  monkeypatch.setattr(cupti, "_extension", lambda: ext)
  monkeypatch.setattr(cupti, "record_layout", lambda: layout)
  monkeypatch.setattr(cupti, "kernel_names", lambda fn, args, nd: list(fn.names))
  monkeypatch.setattr(cupti, "sync_call",
                      lambda args, nd: (_FakeFunction(ext, ["psum"], 1000.0), ()))
  return ext


def test_interleaved_rounds_pair_the_calls(monkeypatch):
  # a and b differ by 1 us per call; a slow phase doubles eight consecutive calls. Call by
  # call, each iteration of b follows one of a (psum in between, not counted), so the phase
  # falls on both: b and a of one iteration are both fast or both slow.
  ext = _fake_session(monkeypatch)
  items = {"a": (_FakeFunction(ext, ["gemm", "cast"], 10.0, skew=2.0), ()),
           "b": (_FakeFunction(ext, ["gemm2"], 11.0, skew=2.0), ())}
  got = alternating.time_alternating(items, iterations=6, rounds=2, warmup=1, timer="cupti",
                                     num_devices=2)
  a, b = got["a"], got["b"]
  assert a.iterations == b.iterations == 6 and a.warmup == 1
  # Round 1 is calls 1-12 (psum, a, psum, b per iteration), round 2 calls 13-24.
  assert a.times_us == pytest.approx([12.0, 24.0, 24.0, 12.0, 12.0, 12.0])
  assert b.times_us == pytest.approx([13.0, 26.0, 26.0, 13.0, 13.0, 13.0])
  assert a.times_min_us == pytest.approx([10.0, 20.0, 20.0, 10.0, 10.0, 10.0])
  assert "call by call" in a.rule and "psum" in a.rule and "2 rounds" in a.rule
  assert "psum" not in a.kernels and a.host_batch_us > 0


def test_interleaved_falls_back_to_rounds_with_the_reason(monkeypatch):
  # Records that cannot be told apart by device: rounds of consecutive calls, saying why.
  ext = _fake_session(monkeypatch, layout=cupti.INTERLEAVED)
  timed = []

  def time_function(fn, args, *, iterations, warmup, timer, num_devices):
    timed.append((fn.names[0], iterations, warmup))
    return timing.Timing(timer=timer, times_us=[fn.us] * iterations, times_min_us=None,
                         rule="fake", iterations=iterations, warmup=warmup)

  monkeypatch.setattr(timing, "time_function", time_function)
  items = {"a": (_FakeFunction(ext, ["gemm"], 10.0), ()),
           "b": (_FakeFunction(ext, ["rs"], 5.0), ())}
  got = alternating.time_alternating(items, iterations=4, rounds=2, warmup=3, timer="cupti",
                                     num_devices=2)
  # Warmed once before the interleaved attempt, so the rounds warm no more.
  assert timed == [("gemm", 2, 0), ("rs", 2, 0), ("gemm", 2, 0), ("rs", 2, 0)]
  assert got["a"].times_us == [10.0] * 4
  assert got["a"].notes == ["records did not split into cycles of the calls: not interleaved"]
  # Different device counts are not interleaved either; neither is the host timer.
  timed.clear()
  items["b"] = items["b"] + (1,)
  got = alternating.time_alternating(items, iterations=2, rounds=1, timer="cupti",
                                     num_devices=2)
  assert "different numbers of devices" in got["b"].notes[0] and len(timed) == 2


def test_interleaved_errors_drop_the_function(monkeypatch):
  ext = _fake_session(monkeypatch)

  class Broken(_FakeFunction):
    def __call__(self, *args):
      raise RuntimeError("lost the GPU")

  errors = []
  items = {"a": (_FakeFunction(ext, ["gemm"], 10.0), ()),
           "b": (Broken(ext, ["x"], 1.0), ())}
  got = alternating.time_alternating(items, iterations=2, rounds=1, warmup=1, timer="cupti",
                                     num_devices=2,
                                     on_error=lambda key, e: errors.append((key, str(e))))
  assert errors == [("b", "lost the GPU")] and set(got) == {"a"}


def test_sync_call_lines_up_the_arguments_devices():
  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  x = jax.device_put(jnp.ones((4, 4)), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("tp")))
  fn, args = cupti.sync_call([(x,), (x, 3)], 2)
  out = fn(*args)
  assert out.shape == (2,) and {d.id for d in out.sharding.device_set} == {0, 1}
  assert cupti.sync_call([(x,)], 4) is None


def test_interleaved_sessions_hold_at_most_512_mib_of_outputs(monkeypatch):
  # Held outputs slow the calls (BUILD_NOTES, eighty-second session), so a round (one CUPTI
  # session) holds at most timing.MAX_OUTPUT_BYTES_IN_FLIGHT of them: more, shorter rounds.
  ext = _fake_session(monkeypatch)
  mib = 1 << 20
  assert timing.MAX_OUTPUT_BYTES_IN_FLIGHT == 512 * mib
  for per_call, rounds in ((50 * mib, 2), (100 * mib, 3), (300 * mib, 6)):
    monkeypatch.setattr(timing, "output_bytes", lambda c, nbytes=per_call: nbytes)
    items = {"a": (_FakeFunction(ext, ["gemm"], 10.0), ()),
             "b": (_FakeFunction(ext, ["rs"], 5.0), ())}
    got = alternating.time_alternating(items, iterations=6, rounds=2, timer="cupti",
                                       num_devices=2)
    # A cycle (a, b) holds 2 x per_call: 5, 2 and 1 cycles a session, so 2 (--rounds), 3, 6.
    assert got["a"].iterations == 6 and f"{rounds} rounds" in got["a"].rule, got["a"].rule
