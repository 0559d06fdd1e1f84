"""experiments/sustained_load.py on CPU: its flag checks, its steps ("N" or "Nms"), the loop it
times (one GEMM run --steps times in one call, not hoisted out of the loop) and its JSON."""
import re

from absl import app
import numpy as np
import pytest

import helpers


@pytest.mark.parametrize("argv, match", [
    (["--steps=4,x"], r"--steps: not N or Nms with N a positive integer: 'x'"),
    (["--steps=4,0"], r"--steps: not N or Nms with N a positive integer: '0'"),
    (["--steps=0ms,ms,5s"], r"--steps: not N or Nms .*: '0ms', 'ms', '5s'"),
    (["--iterations=0"], "--iterations: not a positive integer: 0"),
    (["--k=-8"], "--k: not a positive integer: -8"),
    (["--n=0"], "--n: not a positive integer: 0"),
    (["--functions=xla,cublas"], r"--functions: not one of \['xla', 'kernel'\]: 'cublas'"),
    (["--names=llama70b_o_proj_m513"], "--names: not a shape of pallas_rs/bench/shapes.py"),
    (["--tags=seeds"], "--tags: not a shape tag"),
    (["--devices=0"], "--devices: not a positive integer: 0"),
    (["--devices=3", "--names=llama70b_o_proj_m512,llama70b_o_proj_m2048_proxy8"],
     r"--devices=3 does not divide m of: 'llama70b_o_proj_m512', 'llama70b_o_proj_m2048_proxy8'"),
])
def test_sustained_load_flags(argv, match):
  with (helpers.parsed_script("sustained_load", argv) as mod,
        pytest.raises(app.UsageError, match=match)):
    mod.check_flags()


def test_steps_are_a_count_or_milliseconds_at_the_roofline():
  from pallas_rs.tuning import metrics  # pylint: disable=g-import-not-at-top
  with helpers.parsed_script("sustained_load", []) as mod:
    assert mod.steps_per_call("128", 512, 768, 6144) == 128
    # 2 * 8192^3 flops at 790 TFLOP/s is 1.39 ms: 100 ms is 72 of them, 1 ms one.
    assert metrics.estimate_t_gemm(8192, 8192, 8192) == pytest.approx(1.392e-3, rel=1e-3)
    assert mod.steps_per_call("100ms", 8192, 8192, 8192) == 72
    assert mod.steps_per_call("1ms", 8192, 8192, 8192) == 1
    # Small GEMMs take many: mixtral o_proj at M = 512, D = 8's k_shard (~6 us each).
    assert mod.steps_per_call("200ms", 512, 768, 6144) == 32_700


def test_the_loops_own_kernels_are_left_out_of_the_step():
  # What CUPTI saw of one call of 5 steps on an H100 (2026-12-06): the op's kernel 5 times, the
  # loop counter's increment 4 times; at D >= 2 the op has several kernels, each `steps` times.
  with helpers.parsed_script("sustained_load", []) as mod:
    kernels = {"pallas_rs_local_matmul_mosaic_gpu_kernel": {"count_per_iteration": 5,
                                                            "median_us": 13.4},
               "loop_add_fusion": {"count_per_iteration": 4, "median_us": 1.02},
               "ncclDevKernel_ReduceScatter": {"count_per_iteration": 5, "median_us": 9.0}}
    assert mod.loop_kernels_us(kernels, 5) == pytest.approx(4.08)
    assert mod.loop_kernels_us(kernels, 1) == 0  # no loop: one step
    assert mod.loop_kernels_us(None, 5) == 0  # the host timer names no kernels
    # Two devices: every count covers both, the time is one device's.
    both = {name: dict(k, count_per_iteration=2 * k["count_per_iteration"])
            for name, k in kernels.items()}
    assert mod.loop_kernels_us(both, 5, num_devices=2) == pytest.approx(4.08)
    assert mod.loop_kernels_us(kernels, 5, num_devices=2) == 0  # 4 launches: not 2 x 4


def test_named_shapes_are_their_per_device_problems():
  with helpers.parsed_script("sustained_load", ["--names=mixtral8x22b_o_proj_m512"]) as mod:
    assert mod.problems() == [("mixtral8x22b_o_proj_m512", 512, 768, 6144)]
  with helpers.parsed_script("sustained_load", ["--tags=proxy8"]) as mod:
    got = mod.problems()
  assert len(got) == 16 and all(name.endswith("_proxy8") for name, *_ in got)
  # Names and tags together select as matmul_rs_bench and autotune do: the named shapes that
  # carry every tag, in the table's order.
  names = "--names=mixtral8x22b_w2_m2048_proxy8,llama70b_o_proj_m512,llama70b_o_proj_m512_proxy8"
  with helpers.parsed_script("sustained_load", [names, "--tags=proxy8"]) as mod:
    assert [name for name, *_ in mod.problems()] == ["llama70b_o_proj_m512_proxy8",
                                                    "mixtral8x22b_w2_m2048_proxy8"]
  with (helpers.parsed_script("sustained_load", ["--names=llama70b_o_proj_m512",
                                                 "--tags=proxy8"]) as mod,
        pytest.raises(app.UsageError, match="no shape has every tag of --tags=proxy8")):
    mod.check_flags()
  with helpers.parsed_script("sustained_load", ["--m=64", "--k=32", "--n=48"]) as mod:
    assert mod.problems() == [("m64_k32_n48", 64, 32, 48)]


def _computations(hlo: str) -> dict[str, str]:
  """An HLO module's computations by name (ENTRY's under "ENTRY")."""
  out, name = {}, None
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
      out[name] = ""
    elif name is not None:
      out[name] += line + "\n"
  return out


def _reaches_dot(name: str, computations: dict[str, str]) -> bool:
  text = computations[name]
  return " dot(" in text or any(
      _reaches_dot(callee, computations)
      for callee in re.findall(r"(?:calls|body|to_apply)=%([\w.\-]+)", text))


def test_the_loop_runs_the_gemm_every_step():
  import jax  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  with helpers.parsed_script("sustained_load", []) as mod:
    x, w = testing.generate(0, 64, 32, 48)
    call = mod.repeated("xla", 5)
    got = np.asarray(call(x, w), np.float32)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert got.shape == (64, 48)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    # One GEMM before the loop, 4 in it. Without the barrier XLA hoists the loop's dot out of
    # it (seen on CPU): the optimized HLO must keep one in the loop's body.
    hlo = jax.jit(call).lower(x, w).compile().as_text()
  computations = _computations(hlo)
  [loop] = [line for line in computations["ENTRY"].splitlines() if " while(" in line]
  assert '"known_trip_count":{"n":"4"}' in loop
  assert _reaches_dot(re.search(r"body=%([\w.\-]+)", loop).group(1), computations)


def test_d2_runs_the_unfused_path_every_step_on_its_own_rows():
  # At D >= 2, inside shard_map over 2 of the 8 host devices: each step is the unfused path
  # (dot + psum_scatter), every device's output is its chunk of sum_d x_d @ w_d, and the
  # reduce-scatter stays in the loop.
  import jax  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  with helpers.parsed_script("sustained_load", ["--devices=2"]) as mod:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (mod.AXIS,))
    x, w = testing.generate(3, 128, 2 * 32, 48, num_devices=2,
                            shardings=testing.row_parallel_shardings(mesh, mod.AXIS))
    call = mod.repeated("xla", 3, mesh=mesh)
    got = call(x, w)
    hlo = call.lower(x, w).compile().as_text()
  assert got.shape == (128, 48) and got.sharding.spec[0] == mod.AXIS
  want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2,
                             atol=2e-2 * np.abs(want).max())
  computations = _computations(hlo)
  [loop] = [line for line in computations["ENTRY"].splitlines() if " while(" in line]
  body = computations[re.search(r"body=%([\w.\-]+)", loop).group(1)]
  assert "reduce-scatter" in body or "all-reduce" in body
  assert _reaches_dot(re.search(r"body=%([\w.\-]+)", loop).group(1), computations)


def test_main_writes_every_shape_and_case_as_it_goes(tmp_path, monkeypatch):
  # On CPU: the host timer instead of CUPTI, and XLA's dot standing in for the kernel (it cannot
  # run here); the record must name the config the kernel would run and what "auto" runs.
  import json  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  out = tmp_path / "sustained.json"
  monkeypatch.setattr(fused, "local_matmul", lambda x, w, config: jnp.dot(x, w))
  with helpers.parsed_script("sustained_load", ["--m=128", "--k=64", "--n=192", "--steps=2,3,2",
                                                "--iterations=2", f"--out={out}"]) as mod:
    monkeypatch.setattr(mod.bench_env, "require_cupti", lambda script: None)
    assert mod.main(["sustained_load.py"]) == 0
    want = repr(mod.kernel_config(128, 64, 192))
  doc = json.loads(out.read_text())
  [shape] = doc["problems"]
  assert shape["kernel_config"] == want and want.startswith("Config(")
  assert (shape["name"], shape["m"], shape["k"], shape["n"]) == ("m128_k64_n192", 128, 64, 192)
  assert shape["auto_runs"] == "xla"  # no D = 1 table entry for a CPU
  # The functions take turns, the other way round at every other step; a compile per call shape.
  assert [(c["function"], c["steps"]) for c in shape["cases"]] == [
      ("xla", 2), ("kernel", 2), ("kernel", 3), ("xla", 3), ("xla", 2), ("kernel", 2)]
  assert sorted(shape["compile_s"]) == ["kernel_2", "kernel_3", "xla_2", "xla_3"]
  assert all(len(c["times_us"]) == 2 for c in shape["cases"])


def test_the_table_of_another_gpu_kind_gives_configs_and_decisions():
  # The H200's D = 1 entries (an H100 or a CPU names them with --table_gpu_kind): mixtral w2
  # at M = 512 runs the kernel, llama o_proj at M = 512 XLA's dot; a CPU's own kind has none.
  with helpers.parsed_script("sustained_load", ["--table_gpu_kind=NVIDIA H200"]) as mod:
    assert mod.table_gpu_kind() == "NVIDIA H200"
    assert mod.auto_runs(512, 2048, 6144) == "fused"
    assert mod.auto_runs(512, 1024, 8192) == "xla"
  with helpers.parsed_script("sustained_load", []) as mod:
    assert mod.auto_runs(512, 2048, 6144) == "xla"


def test_main_at_d2_runs_the_public_api_with_the_config_it_records(tmp_path, monkeypatch):
  # The kernel cannot run on CPU: the public API is replaced by one that checks what the script
  # asks of it (the fused kernel, with the config the record names) and runs the unfused path.
  import json  # pylint: disable=g-import-not-at-top
  import pallas_rs  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  asked = []

  def api(x, w, *, axis_name, implementation, config):
    asked.append((implementation, repr(config)))
    return reference.matmul_reduce_scatter(x, w, axis_name=axis_name)

  monkeypatch.setattr(pallas_rs, "matmul_reduce_scatter", api)
  out = tmp_path / "sustained_d2.json"
  with helpers.parsed_script("sustained_load", ["--devices=2", "--m=128", "--k=64", "--n=192",
                                                "--steps=2", "--iterations=1",
                                                f"--out={out}"]) as mod:
    monkeypatch.setattr(mod.bench_env, "require_cupti", lambda script: None)
    assert mod.main(["sustained_load.py"]) == 0
  doc = json.loads(out.read_text())
  [problem] = doc["problems"]
  assert doc["devices"] == 2 and problem["kernel_config"].startswith("Config(")
  assert set(asked) == {("fused", problem["kernel_config"])}
  assert [c["function"] for c in problem["cases"]] == ["xla", "kernel"]
