"""experiments/matmul_rs_bench.py on CPU: flags, schema, smoke end to end."""
import copy
import json
import math
import os
import re
from pathlib import Path
import subprocess
import sys

from absl import app
from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

import helpers
from pallas_rs import reference
from pallas_rs.bench import shapes

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "experiments" / "matmul_rs_bench.py"
PLOT = REPO / "experiments" / "plot_results.py"
FLAGS = flags.FLAGS
# Two small bf16 shapes at D = 8 and D = 2 keep the end-to-end run short.
# ci_min_tile_d2 is a shape the kernel takes: its "fused" record must say "unavailable" (the
# kernel cannot be lowered for CPU), not crash the run.
SMOKE_NAMES = "ci_llama70b_o_proj_d8,ci_llama70b_o_proj_d2,ci_min_tile_d2"


@pytest.fixture(scope="module", autouse=True)
def _forget_script_flags():
  """The scripts' absl flags leave with this file, so that a later test file can load another
  script that defines the same names (experiments/numerics.py's --mode)."""
  yield
  helpers.forget_scripts("matmul_rs_bench", "plot_results")


@pytest.fixture(scope="module")
def bench():
  module = helpers.load_script("matmul_rs_bench")
  if not FLAGS.is_parsed():
    FLAGS.mark_as_parsed()
  return module


@pytest.fixture(scope="module")
def harness(bench):
  del bench  # Loading the main puts experiments/ on sys.path.
  import harness as module  # pylint: disable=g-import-not-at-top
  return module


def _good_record(bench):
  return {
      "mode": "smoke",
      "shape": {"name": "ci_x", "m": 64, "n": 512, "k": 512, "num_devices": 8,
                "k_shard": 64, "m_shard": 8, "dtype": "bfloat16"},
      "implementation": "seq", "status": "ok", "timer": "host_wall_clock",
      "performance_claims": False,
      "timing": {"times_us": [1.0, 2.0], "iterations": 2,
                 "stats": {"median": 1.5, "min": 1.0, "p90": 1.9, "p95": 1.95,
                           "count": 2}},
      "check": {"max_rel_error": 1e-3, "passed": True},
      "throughput": {"tflops": 1.0, "gbps": 1.0}, "metrics": None,
      "estimates": None, "notes": [],
  }


# --- schema ------------------------------------------------------------------


def test_validate_record_accepts_good(bench):
  bench.validate_record(_good_record(bench))
  rec = _good_record(bench)
  rec.update(status="unavailable: NotImplementedError: not built",
             timing=None, timer=None, check=None)
  bench.validate_record(rec)
  rec = _good_record(bench)  # A NaN error, written as null, that failed its check.
  rec["check"].update(max_rel_error=None, passed=False)
  bench.validate_record(rec)


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.pop("timing"), "lacks key='timing'"),
    (lambda r: r.update(mode="gpu"), "mode"),
    (lambda r: r.update(implementation="magic"), "implementation"),
    (lambda r: r.update(status="maybe"), "status"),
    (lambda r: r["shape"].update(m=0), "shape\\['m'\\]"),
    (lambda r: r.update(performance_claims=True), "no performance claims"),
    (lambda r: r["timing"].update(iterations=3), "raw times"),
    (lambda r: r["timing"]["stats"].pop("p95"), "p95"),
    (lambda r: r["check"].update(max_rel_error=-1.0), "max_rel_error"),
    (lambda r: r["check"].update(max_rel_error=None), "a NaN error\\) cannot pass"),
    (lambda r: r.update(status="unavailable: x"), "must not carry a timing"),
    (lambda r: r.update(timer="stopwatch"), "timer"),
])
def test_validate_record_rejects(bench, mutate, match):
  rec = copy.deepcopy(_good_record(bench))
  mutate(rec)
  with pytest.raises(ValueError, match=match):
    bench.validate_record(rec)


# --- environment and flags ------------------------------------------------------


def test_configure_environment_nccl(bench):
  env = {}
  assert bench.configure_environment("multi_gpu", env) == "multi_gpu"
  assert env["NCCL_NVLS_ENABLE"] == "0"
  with pytest.raises(app.UsageError, match="NCCL_NVLS_ENABLE='1'"):
    bench.configure_environment("multi_gpu", {"NCCL_NVLS_ENABLE": "1"})
  with pytest.raises(ValueError, match="mode='fast'"):
    bench.configure_environment("fast", {})


def test_configure_environment_smoke_after_jax_import(bench):
  # conftest imported jax with 8 forced devices: nothing is changed.
  env = {"XLA_FLAGS": ""}
  assert bench.configure_environment("smoke", env) == "smoke"
  assert env == {"XLA_FLAGS": ""}


def test_working_tree_id_names_the_files_as_they_are(bench, tmp_path):
  """git_tree: a checkout's own commit tree when clean (ignored files aside); after an edit and
  a new file, the tree of the commit that will hold them; the real index left alone."""
  del bench  # Loading the main puts experiments/ on sys.path.
  import bench_env  # pylint: disable=g-import-not-at-top
  who = {f"GIT_{r}_{k}": v for r in ("AUTHOR", "COMMITTER") for k, v in
         (("NAME", "t"), ("EMAIL", "t@t"))}

  def git(*args):
    return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                          text=True, env={**os.environ, **who}).stdout.strip()

  git("init", "-q")
  (tmp_path / ".gitignore").write_text("out/\n")
  (tmp_path / "a.py").write_text("x = 1\n")
  git("add", "-A")
  git("commit", "-q", "-m", "one")
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "r.json").write_text("{}")
  assert bench_env.working_tree_id(tmp_path) == git("rev-parse", "HEAD^{tree}")
  (tmp_path / "a.py").write_text("x = 2\n")
  (tmp_path / "b.py").write_text("y = 1\n")
  dirty = bench_env.working_tree_id(tmp_path)
  assert dirty != git("rev-parse", "HEAD^{tree}") and not git("diff", "--cached", "--name-only")
  git("add", "-A")
  git("commit", "-q", "-m", "two")
  assert dirty == git("rev-parse", "HEAD^{tree}")
  assert bench_env.working_tree_id(tmp_path / "absent") is None


def test_flag_parsing(bench):
  with flagsaver.flagsaver():
    FLAGS(["bench", "--mode=smoke", "--implementations=xla,auto",
           "--iterations=7", "--nocheck", "--tags=ci,bf16", "--xla_peer",
           "--timer=host_wall_clock"])
    assert FLAGS.mode == "smoke" and FLAGS.iterations == 7
    assert FLAGS.implementations == ["xla", "auto"]
    assert not FLAGS.check and FLAGS.xla_peer
    assert FLAGS.tags == ["ci", "bf16"]
    assert [c.name for c in bench.select_cases("smoke")] == [
        c.name for c in shapes.select(tags=["ci", "bf16"])]
  with flagsaver.flagsaver():
    with pytest.raises(flags.IllegalFlagValueError):
      FLAGS(["bench", "--mode=fastest"])
  with flagsaver.flagsaver(m=256, n=128, k=None):
    with pytest.raises(app.UsageError, match="go together"):
      bench.select_cases("smoke")
  with flagsaver.flagsaver(m=256, n=128, k=512, num_devices=4):
    (case,) = bench.select_cases("smoke")
    assert (case.m, case.n, case.k, case.num_devices) == (256, 128, 512, 4)
  with flagsaver.flagsaver():
    assert {c.name for c in bench.select_cases("multi_gpu")} == {
        c.name for c in shapes.SEED_CASES}


def test_rounds_flag(bench):
  with flagsaver.flagsaver(rounds=None, iterations=200):
    assert bench.settings_from_flags("cupti").rounds == bench.DEFAULT_GPU_ROUNDS
    assert bench.settings_from_flags("host_wall_clock").rounds == 1
  with flagsaver.flagsaver(rounds=None, iterations=2):
    assert bench.settings_from_flags("cupti").rounds == 2
  with flagsaver.flagsaver(rounds=5, iterations=200):
    assert bench.settings_from_flags("host_wall_clock").rounds == 5
  with flagsaver.flagsaver(rounds=9, iterations=8):
    with pytest.raises(app.UsageError, match="--rounds=9"):
      bench.check_flags()
  assert bench.settings_from_flags("cupti").interleave
  with flagsaver.flagsaver(interleave=False):
    assert not bench.settings_from_flags("cupti").interleave


def test_timing_summary_counts_the_interleaved_records_and_says_why_not(bench):
  from pallas_rs.bench import alternating  # pylint: disable=g-import-not-at-top
  why = "records did not split into cycles of the calls" + alternating.NOT_INTERLEAVED
  records = [{"timing": {"rule": f"one device; {alternating.INTERLEAVED_RULE}", "notes": []}},
             {"timing": {"rule": "one device", "notes": ["other", why]}},
             {"timing": {"rule": "one device", "notes": [why]}}, {"timing": None}]
  assert bench.timing_summary(records) == f"timed call by call: 1 of 3 records\n  {why}"


def test_candidates_are_timed_in_alternating_rounds(harness, monkeypatch):
  # Each candidate's iterations are split over the rounds and the candidates take turns within
  # a round, so a slow phase of the GPUs falls on all of them; one compile each; the record's
  # times are the rounds' in order.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top

  class Fn:
    def __init__(self, name):
      self.name = name

    def __call__(self, a):
      return a * 2

  compiles, calls = [], []

  def time_function(compiled, args, *, iterations, warmup, timer, num_devices):
    calls.append((compiled.name, iterations, warmup))
    return timing.Timing(timer="host_wall_clock", times_us=[float(len(calls))] * iterations,
                         times_min_us=None, rule="fake", iterations=iterations, warmup=warmup)

  monkeypatch.setattr(timing, "compile_function",
                      lambda fn, args: (compiles.append(fn.name) or fn, 0.1))
  monkeypatch.setattr(timing, "time_function", time_function)
  args = (jnp.ones((4, 4), jnp.float32),)
  cands = [harness.Candidate(name, lambda name=name: (Fn(name), args, args),
                             lambda out: (0.0, "ref"), 1.0, 1.0, role=role)
           for name, role in (("seq", "unfused"), ("xla", "judged"))]
  shape = {"name": "ci_x", "m": 4, "n": 4, "k": 4, "num_devices": 1, "k_shard": 4,
           "m_shard": 4, "dtype": "float32"}
  settings = harness.Settings(timer="host_wall_clock", iterations=7, warmup=3, rounds=3)
  seq, xla = harness.run_candidates("smoke", shape, cands, num_devices=1, settings=settings)
  assert compiles == ["seq", "xla"]
  assert calls == [("seq", 3, 3), ("xla", 3, 3), ("seq", 2, 0), ("xla", 2, 0), ("seq", 2, 0),
                   ("xla", 2, 0)]
  assert seq["timing"]["times_us"] == [1.0] * 3 + [3.0] * 2 + [5.0] * 2
  assert xla["timing"]["times_us"] == [2.0] * 3 + [4.0] * 2 + [6.0] * 2
  assert xla["timing"]["iterations"] == 7 and "3 rounds" in xla["timing"]["rule"]
  assert xla["timing"]["compile_s"] == 0.1 and xla["check"]["passed"] is True
  assert timing.round_iterations(7, 3) == [3, 2, 2]
  with pytest.raises(ValueError, match="rounds=8"):
    timing.round_iterations(7, 8)


def test_stream_reference_matches_numpy_reference(harness):
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((4, 16, 8))
  ws = rng.standard_normal((4, 8, 12))
  gemm = np.einsum("dmk,dkn->dmn", xs, ws)
  ref, label, gemm_err = harness.stream_reference(xs, ws, gemm_outs=gemm)
  np.testing.assert_allclose(ref, reference.numpy_reference(xs, ws),
                             rtol=1e-12, atol=1e-12)
  assert label == "numpy float64" and gemm_err < 1e-12


def test_single_gpu_sweep_records_unavailable_on_cpu(bench, harness):
  # The single_gpu code path, run on CPU: XLA baselines time, the fused entry
  # points (not available on CPU) are recorded as unavailable, never faked.
  settings = harness.Settings(timer="host_wall_clock", iterations=2, warmup=1)
  recs = harness.sweep_single_gpu([shapes.custom_case(64, 128, 256, 8)],
                                  loopback_devices=(2, 8), settings=settings)
  recs = [bench.sanitize(r) for r in recs]
  for r in recs:
    bench.validate_record(r)
  got = {(r["shape"]["name"], r["implementation"]): r["status"] for r in recs}
  assert len(got) == 8  # local x2, loopback (D = 2, 8) x3
  for (name, impl), status in got.items():
    if impl in ("local_fused", "loopback_fused"):
      assert status.startswith("unavailable: "), (name, impl, status)
    else:
      assert status == "ok", (name, impl, status)
  for r in recs:
    if r["status"] == "ok":
      assert r["check"]["passed"] and r["check"]["max_rel_error"] < 1e-2


def test_judged_record_without_unfused_error_is_not_a_pass(bench, harness):
  # The unfused candidate is unavailable, so the judged one's error rule cannot be applied:
  # its record must not say passed (nor "ok" in the table), and the run's exit rule sees it.
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def unavailable():
    raise NotImplementedError("no unfused path here")

  fn, args = jax.jit(lambda a: a * 2), (jnp.ones((4, 4), jnp.float32),)
  cands = [harness.Candidate("seq", unavailable, lambda out: (0.0, "ref"), 1.0, 1.0,
                             role="unfused"),
           harness.Candidate("xla", lambda: (fn, args, args), lambda out: (0.5, "ref"), 1.0,
                             1.0, role="judged")]
  shape = {"name": "ci_x", "m": 4, "n": 4, "k": 4, "num_devices": 1, "k_shard": 4,
           "m_shard": 4, "dtype": "float32"}
  settings = harness.Settings(timer="host_wall_clock", iterations=2, warmup=1)
  seq, judged = harness.run_candidates("smoke", shape, cands, num_devices=1, settings=settings)
  assert seq["status"].startswith("unavailable: ")
  bench.validate_record(bench.sanitize(judged))
  assert judged["check"]["passed"] is False
  assert judged["check"]["rule_applied"] is False
  assert judged["check"]["ratio_to_unfused"] is None
  table = bench.format_table([judged])
  assert "UNCHECKED" in table and " ok" not in table.splitlines()[-1]
  assert "UNCHECKED" in bench.progress_line(1, 1, [judged], 0.0)
  # With the unfused error present the same record is judged.
  good = harness.check_block(0.5, "ref", role="judged", unfused_err=1.0, max_error_ratio=1.1)
  assert good["rule_applied"] is True and good["passed"] is True
  # A NaN output fails in every role, and its record (the error written as null) stays valid.
  for role, unfused_err in (("judged", 1.0), ("unfused", None), ("baseline", None)):
    nan = harness.check_block(math.nan, "ref", role=role, unfused_err=unfused_err,
                              max_error_ratio=1.1)
    assert nan["passed"] is False, role
    bench.validate_record(bench.sanitize(dict(judged, check=nan)))


def test_table_prints_the_microseconds_above_perfect_overlap(bench):
  # Issue 19's small-M bound (T_fused <= max(T_gemm, T_comm) + 5 us) read off the table.
  rec = _good_record(bench)
  rec.update(implementation="fused", timer="cupti", performance_claims=True,
             metrics={"overlap_efficiency": 0.5, "t_ideal_us": 42.0, "speedup_vs_seq": 1.1})
  rec["timing"]["stats"]["median"] = 50.5
  header, _, row = bench.format_table([rec, _good_record(bench)]).splitlines()[:3]
  at = header.index("over_us")
  assert row[at:at + 7].strip() == "8.5"  # 50.5 - 42.0, not E or the speedup
  no_claims = bench.format_table([_good_record(bench)]).splitlines()[2]
  assert no_claims[at:at + 7].strip() == "-"


# --- end to end -----------------------------------------------------------------


def test_smoke_end_to_end(tmp_path):
  out = tmp_path / "smoke.json"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the script must force the 8 host devices itself
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, str(BENCH), "--mode=smoke", f"--names={SMOKE_NAMES}",
         "--iterations=3", "--rounds=3", "--warmup=1", "--implementations=xla,fused,auto",
         "--xla_peer", f"--out={out}"]
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path, check=False)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "no performance claims" in res.stdout
  doc = json.loads(out.read_text())
  bench = helpers.load_script("matmul_rs_bench")
  bench.validate_results(doc)
  assert doc["mode"] == "smoke" and doc["timer"] == "host_wall_clock"
  assert doc["environment"]["device_count"] == 8
  assert "--xla_force_host_platform_device_count=8" in (
      doc["environment"]["XLA_FLAGS"])
  by = {(r["shape"]["name"], r["implementation"]): r for r in doc["records"]}
  for name in SMOKE_NAMES.split(","):
    for impl in ("gemm", "comm", "seq", "xla", "auto", "xla_windowed_einsum"):
      rec = by[(name, impl)]
      assert rec["status"] == "ok", rec["status"]
      assert len(rec["timing"]["times_us"]) == 3
      assert rec["check"]["passed"]
    assert by[(name, "fused")]["status"].startswith("unavailable: NotImplementedError")
    xla = by[(name, "xla")]
    assert xla["check"]["ratio_to_unfused"] == pytest.approx(1.0)
    assert set(xla["metrics"]) >= {"overlap_efficiency", "speedup_vs_seq",
                                   "comm_hidden_fraction", "fused_over_ideal"}
    lo, hi = xla["metrics"]["overlap_efficiency_ci95"]  # three rounds: an interval
    assert lo <= hi
    assert "windowed_dot_general" in by[(name, "xla_windowed_einsum")]["hlo"]

  plots = tmp_path / "plots"
  res = subprocess.run([sys.executable, str(PLOT), f"--results={out}",
                        f"--out_dir={plots}"], capture_output=True, text=True,
                       timeout=120, check=False)
  assert res.returncode == 0, res.stderr[-3000:]
  assert sorted(p.name for p in plots.glob("*.png")) == [
      "smoke_efficiency.png", "smoke_times.png"]


def test_plot_single_gpu_json(tmp_path):
  # Plots of a (synthetic) single_gpu results file.
  plot = helpers.load_script("plot_results")
  rec = {"status": "ok", "timing": {"stats": {"median": 10.0}}, "metrics": None}
  doc = {"mode": "single_gpu", "timer": "cupti", "performance_claims": True,
         "environment": {"device_kind": "H200", "device_count": 1},
         "records": [
             dict(rec, shape={"name": "a_local"}, implementation="local_xla"),
             dict(rec, shape={"name": "a_local"}, implementation="local_fused",
                  metrics={"fused_over_xla": 0.95}),
             dict(rec, shape={"name": "a_loopback"},
                  implementation="loopback_reference"),
             dict(rec, shape={"name": "a_loopback"},
                  implementation="loopback_gemm"),
             {"status": "unavailable: x", "timing": None, "metrics": None,
              "shape": {"name": "a_loopback"},
              "implementation": "loopback_fused"},
         ]}
  path = tmp_path / "single_gpu_x.json"
  path.write_text(json.dumps(doc))
  with flagsaver.flagsaver(target=0.9):
    written = plot.plot_file(path, tmp_path)
  assert sorted(p.name for p in written) == [
      "single_gpu_x_local_ratio.png", "single_gpu_x_loopback.png"]
  assert all(p.stat().st_size > 0 for p in written)


def test_plot_model_bench_json(tmp_path):
  # The block plot of a (synthetic) model_bench results file: one PNG, one bar per
  # implementation and (M, pass); records without metrics (no_comm) are left out.
  plot = helpers.load_script("plot_results")
  shape = {"model": "llama70b", "m": 2048, "num_devices": 2}
  def rec(impl, metrics):
    return {"shape": shape, "pass": "forward", "implementation": impl, "status": "ok",
            "timer": "cupti", "performance_claims": True, "metrics": metrics}
  doc = {"benchmark": "model_bench", "flags": {"mode": "multi_gpu"},
         "environment": {"device_kind": "H200", "device_count": 2},
         "records": [rec("xla", {"speedup_vs_xla": 1.0, "exposed_comm_share": 0.08}),
                     rec("no_comm", None),
                     rec("auto", {"speedup_vs_xla": 1.03, "exposed_comm_share": 0.05})]}
  path = tmp_path / "model_x.json"
  path.write_text(json.dumps(doc))
  assert plot.why_not_plotted(doc) is None
  (written,) = plot.plot_file(path, tmp_path)
  assert written.name == "model_x_block.png" and written.stat().st_size > 0
  assert plot.why_not_plotted({"benchmark": "model_bench"}) is not None
  # A --per_layer run: the XLA block's exposed communication by projection, a second PNG.
  doc["records"][0]["metrics"]["exposed_comm_by_layer_us"] = {
      "qkv": 40.0, "o_proj": 55.0, "gate_up": 38.0, "down_proj": None}
  path.write_text(json.dumps(doc))
  written = plot.plot_file(path, tmp_path)
  assert [p.name for p in written] == ["model_x_block.png", "model_x_layers.png"]
  assert written[1].stat().st_size > 0


def test_seed_shapes_run_at_the_visible_device_count(harness):
  seed = shapes.by_name("llama70b_o_proj_m2048")
  proxy = shapes.by_name("llama70b_o_proj_m2048_proxy8")
  ci = shapes.by_name("ci_llama70b_o_proj_d2")
  for visible in (2, 4, 8):
    assert harness.devices_for(seed, visible) == visible
    assert harness.devices_for(proxy, visible) == 2
    assert harness.devices_for(ci, visible) == 2
  assert harness.devices_for(seed, 8, override=4) == 4
  # Labelled with the real D: the renamed case and the record's shape block.
  case = seed.with_num_devices(harness.devices_for(seed, 2))
  block = harness.shape_block(case)
  assert (case.name, block["num_devices"], block["k_shard"]) == (
      "llama70b_o_proj_m2048_d2", 2, 4096)
  assert harness.cases_at([seed, proxy], 2) == [case, proxy]
  with pytest.raises(ValueError, match="needs 4 devices, have 2"):
    harness.cases_at([seed], 2, override=4)


def test_proxy8_shapes_have_the_d8_k_shard_at_d2():
  proxies = shapes.select("proxy8")
  assert len(proxies) == 16
  by_seed = {c.name: c for c in shapes.SEED_CASES}
  for p in proxies:
    seed = by_seed[p.name.removesuffix("_proxy8")]
    assert p.num_devices == 2 and (p.m, p.n) == (seed.m, seed.n)
    assert p.k_shard == seed.k // 8 == seed.k_shard


def test_proxy8_flag_selects_the_proxies(bench):
  with flagsaver.flagsaver(tags=["proxy8"]):
    assert bench.select_cases("multi_gpu") == list(shapes.select("proxy8"))


@pytest.mark.slow  # An experiment script end to end (~10 s): the slow layer (tests/conftest.py).
def test_readme_plot_command_on_the_committed_results(tmp_path):
  # experiments/README.md's plot command, as written but for --out_dir: every committed JSON is
  # plotted or skipped with one line (autotune, numerics, probe and check files are other
  # schemas; harness and model_bench files are plotted), and the run succeeds.
  readme = (REPO / "experiments" / "README.md").read_text()
  (pattern,) = re.findall(r"plot_results\.py --results='([^']+)'", readme)
  res = subprocess.run([sys.executable, str(PLOT), f"--results={pattern}",
                        f"--out_dir={tmp_path}"], capture_output=True, text=True,
                       timeout=300, check=False, cwd=REPO)
  assert res.returncode == 0, res.stderr[-3000:]
  plot = helpers.load_script("plot_results")
  committed = sorted((REPO / "experiments" / "results").glob("*.json"))
  assert len(committed) >= 3
  lines = res.stdout.splitlines()
  for path in committed:
    doc = json.loads(path.read_text())
    rel = str(path.relative_to(REPO))
    skipped = [l for l in lines if l.startswith(f"skip {rel}: ")]
    if plot.why_not_plotted(doc) is None:
      assert not skipped, skipped
      assert any(l.startswith(f"wrote {tmp_path / path.stem}_") for l in lines), rel
    else:
      assert len(skipped) == 1, (rel, res.stdout[-3000:])
  assert lines[-1].startswith("plotted ")
  assert list(tmp_path.glob("*.png"))


# --- progress and partial results ----------------------------------------------

_STOP_AT_SHAPE_3 = """
import harness
_sharded_records, _done = harness.sharded_records, []
def sharded_records(mode, case, *args, **kwargs):
  if len(_done) == 2:
    raise RuntimeError("stand-in: the run is cut short at shape 3")
  _done.append(case.name)
  return _sharded_records(mode, case, *args, **kwargs)
harness.sharded_records = sharded_records
"""


@pytest.mark.slow  # An experiment script end to end: the slow layer (tests/conftest.py).
def test_progress_lines_and_json_written_after_each_shape(tmp_path):
  # A run cut short (an exception at shape 3, --keep_going off) keeps the 2 shapes it measured:
  # a line per shape as it completes, and the JSON rewritten after each.
  out = tmp_path / "partial.json"
  names = [c.name for c in shapes.select(names=["ci_llama70b_o_proj_d2", "ci_min_tile_d2",
                                                  "ci_llama70b_o_proj_d8"])]  # run in this order
  res = helpers.run_script_with_stand_ins(
      "matmul_rs_bench.py", ["--mode=smoke", f"--names={','.join(names)}", "--iterations=2",
                             "--warmup=0", f"--out={out}"],
      stand_ins=_STOP_AT_SHAPE_3, timeout=300)
  assert res.returncode != 0 and "cut short at shape 3" in res.stderr, res.stderr[-3000:]
  progress = [l for l in res.stdout.splitlines() if l.startswith("[")]
  assert [l.split()[:2] for l in progress] == [["[1/3]", names[0]], ["[2/3]", names[1]]], (
      res.stdout)
  assert all("seq" in l and "xla" in l for l in progress), progress
  doc = json.loads(out.read_text())
  assert doc["complete"] is False
  assert [r["shape"]["name"] for r in doc["records"]] == [names[0]] * 4 + [names[1]] * 4
  helpers.load_script("matmul_rs_bench").validate_results(doc)


def test_help_names_the_default_output_folder_and_it_is_ignored():
  # --help names the folder the run really writes to when --out is not given, and git ignores it.
  bench = helpers.load_script("matmul_rs_bench")
  import bench_env  # pylint: disable=g-import-not-at-top  (experiments/ is on sys.path now)
  res = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True,
                       timeout=120, check=False, cwd=REPO)
  assert "--out" in res.stdout, res.stderr[-2000:]  # (absl's --help exits with 1)
  for mode in ("smoke", "multi_gpu", "single_gpu"):
    path = bench.default_out_path(mode)
    assert path.parent == bench_env.OUT_DIR and path.name.startswith(f"{mode}_"), path
  assert bench_env.OUT_DIR_NAME in FLAGS["out"].help
  assert f"default {bench_env.OUT_DIR_NAME}" in " ".join(res.stdout.split()), res.stdout
  assert "experiments/results/<mode>" not in res.stdout
  rel = bench_env.default_out("x.json").relative_to(REPO)
  ignored = subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=REPO, check=False)
  assert ignored.returncode == 0, f"{rel} is not git-ignored"


def test_every_script_defaults_to_the_ignored_folder():
  # Each experiment script with an --out flag builds its default path with bench_env.default_out
  # (experiments/out/, git-ignored), never under the curated experiments/results/.
  scripts = sorted((REPO / "experiments").glob("*.py"))
  with_out = [p for p in scripts if re.search(r'DEFINE_string\(\s*"out"', p.read_text())]
  assert len(with_out) >= 8, with_out
  for path in with_out:
    text = path.read_text()
    assert '"results" /' not in text, path.name
    help_text = re.search(r'DEFINE_string\(\s*"out",(.*?)\)\n', text, re.S).group(1)
    if "default_out" in text:
      assert "experiments/out/" in help_text, (path.name, help_text)
    else:  # No default path: the script writes nothing without --out.
      assert "if _OUT.value:" in text, path.name
