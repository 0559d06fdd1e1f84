"""experiments/nvlink_roofline.py on CPU: every kernel variant lowers for CUDA at D = 2 (the
script's --lower_only on 8 forced CPU devices), and its checks, statistics, JSON, PNG and table
with the kernels and the timer replaced by stand-ins (Mosaic GPU kernels cannot run on a CPU)."""
import json

import numpy as np
import pytest

import helpers

SCRIPT = "nvlink_roofline.py"

# Plain-JAX stand-ins: what each kernel computes (independently of the script's
# expected_output, so the script's check logic is tested too), and a fixed timer.
AFTER_LOAD = """
import math
import jax, jax.numpy as jnp
from jax import lax

def emulated_kernel_fn(v, num_devices, axis):
  outs = mod.out_types(v)
  zeros = lambda t: jnp.zeros((math.prod(t.shape),), t.dtype)
  to_next = [(r, (r + 1) % num_devices) for r in range(num_devices)]
  from_next = [((r + 1) % num_devices, r) for r in range(num_devices)]
  def f(src):
    if v.mechanism == "hol":
      cta = jnp.arange(v.ctas, dtype=jnp.int32)
      ns = 1000 + 100 * cta + 10000 * (cta < v.hol_store_ctas).astype(jnp.int32)
      return jnp.stack([ns, 2 * ns], axis=1), zeros(outs[1])
    if not v.check:
      return (jnp.arange(v.ctas, dtype=jnp.int32) if v.mechanism == "pull" else zeros(outs[0]),)
    ce, n = v.chunk_elems, v.chunks_per_cta
    if v.mechanism == "pull":
      return (lax.ppermute(src[: v.ctas * n * ce], axis, from_next),)
    slots = src[: v.ctas * v.inflight * ce].reshape(-1, ce)
    data = slots[jnp.array([c * v.inflight + j % v.inflight
                            for c in range(v.ctas) for j in range(n)])].reshape(-1)
    return (lax.ppermute(data, axis, to_next) if v.mechanism == "push" else data,)
  return f

def fake_measure(compiled, args, *, kernel_name, iterations, warmup, num_devices, timer):
  jax.block_until_ready(compiled(*args))
  return dict(timer="stand_in", times_us=[100.0 + i for i in range(iterations)],
              times_min_us=None, step_times_us=[105.0] * iterations, rule="stand-in",
              kernels=None, notes=["stand-in timer"])

mod.kernel_fn = emulated_kernel_fn
mod.measure = fake_measure
mod.require_gpus = lambda d: jax.devices()[:d]
"""


@pytest.fixture(scope="module")
def roofline():
  yield helpers.load_script("nvlink_roofline")
  helpers.forget_scripts("nvlink_roofline")  # Its absl flags share names with other scripts'.


def _run(args, tmp_path, name, after_load=""):
  out = tmp_path / f"{name}.json"
  proc = helpers.run_script_with_stand_ins(SCRIPT, [*args, f"--out={out}"], stand_ins="",
                                           after_load=after_load)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("extra", [
    [],  # exactly what experiments/run_multi_gpu.sh roofline builds (flat, both directions)
    pytest.param(["--layouts=flat,tiled", "--pull_handshake", "--directions=one"],
                 marks=pytest.mark.slow),  # the optional variants
], ids=["defaults", "tiled_handshake_oneway"])
def test_every_variant_lowers_for_cuda_at_d2(tmp_path, extra):
  result, stdout = _run(["--lower_only", *extra], tmp_path, "lower")
  rows = result["lowering"]
  layouts = 2 if extra else 1
  # Warpgroup lowering of a remote TMA load: refused by jax 0.10.2, accepted from jax commit
  # 15524cbd on (with jaxlib >= 0.11.1); the script drops the Warpgroup pulls where refused.
  finding = result["findings"]["pull_warpgroup_semantics"]
  if finding == "lowers":
    pull_semantics = 2
  else:
    pull_semantics = 1
    assert finding.startswith("NotImplementedError") and "peer ids are not supported" in finding
  mechs = 2 + pull_semantics  # push, local, pull per semantics
  # checks (mechanisms x layouts) + mechanisms x layouts x 3 inflight x 6 ctas + 6 hol cases
  assert len(rows) == mechs * layouts * (1 + 3 * 6) + 6, [r["variant"] for r in rows]
  assert all(r["ok"] for r in rows), [(r["variant"], r.get("error")) for r in rows if not r["ok"]]
  assert len({r["variant"] for r in rows}) == len(rows)  # one kernel name each
  for r in rows:
    if r["variant"].startswith("hol"):
      assert {"globaltimer", "%clock"} <= set(r["tma"]), r
    elif "_tiled_" in r["variant"]:
      assert r["tma"] == ["cp.async.bulk.tensor"], r
    else:  # flat chunks: the CUDA benchmark's 1-D bulk copies, no tensor map
      assert "cp.async.bulk.tensor" not in r["tma"], r
    pull_lane = r["variant"].startswith("pull") and "warpgroup" not in r["variant"]
    assert r["semantics"] == ("lane" if pull_lane else "warpgroup")
  assert result["settings"]["performance_claims"] is False
  assert "lowered" in stdout.strip().splitlines()[-1]


def test_refuses_without_gpus(tmp_path):
  proc = helpers.run_script_with_stand_ins(SCRIPT, [f"--out={tmp_path / 'x.json'}"],
                                           stand_ins="")
  assert proc.returncode != 0
  assert "needs --num_devices >= 2 and that many GPUs" in proc.stderr
  assert "--lower_only" in proc.stderr


def test_refuses_nvls(tmp_path, monkeypatch):
  monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
  proc = helpers.run_script_with_stand_ins(SCRIPT, ["--lower_only", "--mechanisms=hol",
                                                    f"--out={tmp_path / 'x.json'}"], stand_ins="")
  assert proc.returncode != 0 and "NCCL_NVLS_ENABLE='1'" in proc.stderr


@pytest.mark.slow  # The script end to end with stand-ins: the slow layer (tests/conftest.py).
def test_plumbing_with_stand_ins(tmp_path):
  result, stdout = _run(
      ["--ctas=1,2,200", "--inflight=1,2", "--bytes_per_cta_kb=128", "--hol_ctas=4",
       "--iterations=3", "--warmup=1", "--layouts=flat,tiled"], tmp_path, "plumbing",
      # As where Mosaic lowers Warpgroup pulls (jax >= 0.11.1), so both pull kinds run.
      after_load=AFTER_LOAD + "mod.pull_warpgroup_finding = lambda mesh: 'lowers'\n")
  env = result["environment"]
  assert env["jax_version"] and "git_commit" in env
  # The checks compare the script's expected data with the emulated kernels'.
  assert len(result["checks"]) == 8 and all(c["ok"] for c in result["checks"]), result["checks"]
  assert result["findings"]["remote_tma_load_lane"].startswith("checked")
  assert result["findings"]["remote_tma_load_warpgroup"].startswith("checked")
  records = result["records"]
  # (push, pull in 2 semantics, local) x layouts x inflight x ctas
  assert len(records) == 4 * 2 * 2 * 3
  skipped = [r for r in records if r["ctas"] == 200]
  assert skipped and all(r["status"].startswith("skipped: 200 CTAs > 132 SMs") for r in skipped)
  for r in (r for r in records if r["status"] == "ok"):
    assert r["times_us"] == [100.0, 101.0, 102.0] and r["median_us"] == 101.0
    assert r["gbps_total"] == pytest.approx(r["ctas"] * (128 << 10) / 101.0 / 1e3)
    assert r["gbps_per_sm"] == pytest.approx(r["gbps_total"] / r["ctas"])
    if r["ctas"] == 1:
      ref = {"push": 45, "pull": 94, "local": 55}[r["mechanism"]]
      assert r["reference_gbps"] == ref and r["ratio"] == pytest.approx(r["gbps_total"] / ref)
    else:
      assert r["reference_gbps"] is None and r["ratio"] is None
    assert r["step_median_us"] == 105.0
  hol = {h["case"]: h for h in result["hol"]}
  assert set(hol) == {"none", "local_all", "peer_one", "peer_half", "peer_all", "peer_all_16k"}
  # Stand-in latency: 1000 + 100 cta ns, + 10 us on the CTAs that stored.
  assert hol["none"]["latency"]["probe_median_us"] == pytest.approx(1.15)
  assert hol["peer_one"]["latency"]["probe_median_us"] == pytest.approx(11.0)
  assert hol["peer_one"]["latency"]["others_median_us"] == pytest.approx(1.2)
  assert hol["peer_half"]["latency"]["probe_median_us"] == pytest.approx(11.05)
  assert hol["peer_all"]["latency"]["cycles_per_ns"] == pytest.approx(2.0)
  assert hol["peer_all"]["ratio"] == pytest.approx(hol["peer_all"]["latency"]["probe_median_us"]
                                                   / 22.0)
  assert result["plot"].endswith(".png") and (tmp_path / "plumbing.png").stat().st_size > 0
  lines = stdout.strip().splitlines()
  assert lines[-1].startswith("peer_all_16k")  # the head-of-line table is printed last
  assert any(line.startswith("push/tiled") for line in lines)
  assert any(line.startswith("pull/tiled/wg") for line in lines)
  assert any(line.startswith("pull/wg") for line in lines)


def test_variant_rules(roofline):
  v = roofline.Variant
  assert v("push", 8, inflight=4).smem_bytes == 4 * 32 << 10
  with pytest.raises(ValueError, match="exceeds"):
    v("pull", 1, inflight=8)  # 256 KB of SMEM
  with pytest.raises(ValueError, match="rows a multiple of 8 <= 256"):
    v("push", 1, layout="tiled", chunk_bytes=128 << 10, bytes_per_cta=128 << 10)
  with pytest.raises(ValueError, match="handshake"):
    v("push", 1, handshake=True)
  assert v("hol", 132, hol_case="peer_half").hol_store_ctas == 66
  assert v("hol", 132, hol_case="none").hol_store_ctas == 0
  names = [x.name for x in roofline.bandwidth_variants(
      ["push", "pull", "local"], [1, 2, 132], [1, 4], ["flat", "tiled"],
      pull_semantics=["lane", "warpgroup"])]
  assert len(set(names)) == len(names) == 48
  assert "pull_flat_c2_i4_warpgroup" in names and "pull_flat_c2_i4" in names


def test_reference_figures(roofline):
  assert roofline.reference_gbps("push", 8) == (318.5, [316.0, 321.0])
  assert roofline.reference_gbps("pull", 132)[0] == 370
  assert roofline.reference_gbps("push", 132, both_ways=True)[0] == 364
  assert roofline.reference_gbps("local", 2) == (None, None)
  assert roofline.gbps(4 << 20, 1000.0) == pytest.approx(4.194304)


def test_hol_stats_unsigned_wrap(roofline):
  v = roofline.Variant("hol", 4, hol_case="peer_half")
  lat = np.zeros((2, 2, 4, 2), np.int64)
  lat[..., 0] = 700
  lat[:, :, :2, 0] = 20000
  lat[..., 1] = 2 * lat[..., 0]
  lat = lat.astype(np.int32)
  lat[0, 0, 0] = [np.int32(-2**31 + 5), np.int32(7)]  # a counter that wrapped: 2^31 + 5
  stats = roofline.hol_stats(lat, v, 2)
  assert stats["probe_median_us"] == pytest.approx(20.0)
  assert stats["others_median_us"] == pytest.approx(0.7)
  assert max(max(row) for row in stats["per_cta_median_us"]) > 1e6  # unsigned, not negative
