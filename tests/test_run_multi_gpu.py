"""experiments/run_multi_gpu.sh on a CPU machine: each step's calls, as the shell builds them, go
through their script's flag parsing and `check_flags()` (experiments/flag_checks.py), and each
pytest selection it runs selects tests, so that a misspelt shape, config variant or flag in a
queued multi-GPU step fails here and not on the device's time. Nothing is run: `python3`,
`timeout` and `nvidia-smi` are stand-ins that record the calls."""
import os
from pathlib import Path
import re
import subprocess
import sys

from absl import app
from absl import flags
import pytest

import helpers

SCRIPT = helpers.REPO / "experiments" / "run_multi_gpu.sh"
_SEP = "\x1f"
_STAND_INS = {
    "python3": f'printf "%s{_SEP}" "$@" >> "$CALLS"; printf "\\n" >> "$CALLS"; echo stand-in',
    "timeout": 'shift; exec "$@"',
    "nvidia-smi": 'echo "${GPU_NAME:-stand-in}"',
}
_PATH_FLAGS = ("out", "table", "trace_dir")


def _bodies() -> dict[str, str]:
  """{step: the text of its case branch}."""
  text = SCRIPT.read_text()
  parts = re.split(r"^  ([\w|]+)\)$", text, flags=re.M)[1:]
  return {mode: body.split(";;")[0] for label, body in zip(parts[::2], parts[1::2])
          for mode in label.split("|")}


def _modes() -> dict[str, list[str]]:
  """The step names as the header lists them, as the case labels take them, as usage names them."""
  text = SCRIPT.read_text()
  header = re.findall(r"^#   OUT=\S+ bash experiments/run_multi_gpu.sh (\w+)", text, re.M)
  cases = list(_BODIES)
  usage = re.search(r'echo "usage: \$0 ([\w|]+)"', text.replace("\\\n", ""))[1].split("|")
  return dict(header=header, cases=cases, usage=usage)


_BODIES = _bodies()
# A step with a part for one card only (`nvidia-smi` naming an H200) runs here twice: as the
# stand-in card and as an H200 ("<step>@h200"), so that both parts' calls are checked.
_H200 = "@h200"
MODES = list(_BODIES) + [mode + _H200 for mode, body in _BODIES.items()
                         if re.search(r"grep [^\n]*H200", body)]
PYTEST_MODES = [mode for mode, body in _BODIES.items() if "-m pytest" in body]


def test_every_step_is_listed_in_the_header_and_the_usage_line():
  modes = {where: set(names) for where, names in _modes().items()}
  for where in ("header", "usage"):
    assert modes[where] == modes["cases"], (
        f"{where}: lacks {sorted(modes['cases'] - modes[where])}, "
        f"has no step {sorted(modes[where] - modes['cases'])}")


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
  """{mode: (the recorded calls, each a list of arguments; the step's stderr; $OUT; $TMPDIR)}."""
  root = tmp_path_factory.mktemp("run_multi_gpu")
  bin_dir = root / "bin"
  bin_dir.mkdir()
  for name, body in _STAND_INS.items():
    (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
    (bin_dir / name).chmod(0o755)
  recorded = {}
  for mode in MODES:
    out, tmp, log = root / mode / "out", root / mode / "tmp", root / mode / "calls"
    tmp.mkdir(parents=True)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out),
               TMPDIR=str(tmp), CALLS=str(log), GPU_NAME=(
                   "NVIDIA H200" if mode.endswith(_H200) else "stand-in"))
    proc = subprocess.run(["bash", str(SCRIPT), mode.removesuffix(_H200)], cwd=helpers.REPO,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    lines = log.read_text().splitlines() if log.exists() else []
    recorded[mode] = ([line.split(_SEP)[:-1] for line in lines], proc.stderr, out, tmp)
  return recorded


def _script_calls(call_list):
  return [c for c in call_list if c and c[0].startswith("experiments/")]


@pytest.mark.parametrize("mode", MODES)
def test_step_calls_parse_and_pass_their_checks(calls, mode):
  call_list, stderr, out, tmp = calls[mode]
  assert not re.search(r"unbound variable|syntax error|command not found", stderr), stderr
  assert call_list, f"step {mode} called no python3"
  for call in _script_calls(call_list):
    script = Path(call[0]).stem
    with helpers.parsed_script(script, call[1:]) as module:
      if hasattr(module, "check_flags"):
        module.check_flags()
      for name in _PATH_FLAGS:
        value = flags.FLAGS[name].value if name in flags.FLAGS else None
        if value:  # Written under $OUT (what the device tool brings back) or the step's temp.
          assert Path(value).is_relative_to(out) or Path(value).is_relative_to(tmp), (
              f"{mode}: {script} --{name}={value} outside $OUT")


@pytest.mark.parametrize("mode", [m for m in MODES if m.endswith(_H200)])
def test_an_h200_only_part_is_reached_as_an_h200(calls, mode):
  def relative(m):  # Each run writes under its own $OUT.
    out = str(calls[m][2])
    return [[arg.replace(out, "$OUT") for arg in call] for call in _script_calls(calls[m][0])]
  assert relative(mode) != relative(mode.removesuffix(_H200)), (
      f"{mode}: the same calls as on the stand-in card")


# The slow layer: a pytest collection per selection (~30 s in all on 2 CPU cores).
@pytest.mark.slow
@pytest.mark.parametrize("mode", PYTEST_MODES)
def test_step_pytest_selections_select_tests(calls, mode):
  selections = [c[c.index("pytest") + 1:] for c in calls[mode][0] if "pytest" in c]
  assert selections
  for args in selections:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
                          cwd=helpers.REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"{mode}: pytest {' '.join(args)} selects nothing:\n" \
                                 f"{proc.stdout[-2000:]}"


# Steps that time configs over NVLink on four GPUs, every (shape, config) of them meant to run:
# one that NVLink refuses (fused.nvlink_unverified) or the kernel cannot take would cost a
# device call to find. (The pull itself needs jax >= 0.11.2, which this CPU machine lacks.)
_NVLINK_D4_STEPS = ("pull_wm", "chains")


@pytest.mark.parametrize("mode", _NVLINK_D4_STEPS)
def test_four_gpu_step_configs_run_over_nvlink(calls, mode):
  variants = helpers.load_script("config_variants")  # (no flags: nothing to forget)
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top
  d, checked = 4, 0
  for call in _script_calls(calls[mode][0]):
    if Path(call[0]).stem != "ablate":
      continue
    # ablate's own flags: defaults and bare --unverified too.
    with helpers.parsed_script("ablate", call[1:]):
      unverified, names, configs = (flags.FLAGS[f].value
                                    for f in ("unverified", "names", "configs"))
    assert not unverified, call
    for name in names:
      case = shapes.by_name(name)
      base = variants.tuned_config(m=case.m, k_shard=case.k // d, n=case.n,
                                   dtype="bfloat16", num_devices=d)
      for variant in configs:
        cfg = variants.variant_config(base, variant)
        cfg.check_shape(m=case.m, n=case.n, k_shard=case.k // d, num_devices=d)
        assert fused.nvlink_unverified(cfg, d) is None, (mode, name, variant)
        checked += 1
  assert checked


def test_a_misspelt_shape_or_variant_stops_the_script_before_it_runs():
  for argv, match in ((["--names=llama70b_o_proj_m51"], "--names: not a shape.*m51"),
                      (["--configs=table,p4_rnig"], "--configs: unknown variant token 'rnig'"),
                      (["--ablations=fused,nither"], "--ablations: not one of.*'nither'")):
    with (helpers.parsed_script("ablate", argv) as ablate,
          pytest.raises(app.UsageError, match=match)):
      ablate.check_flags()


@pytest.mark.parametrize("script,argv,match", [
    ("autotune", ["--iterations=0"], "--iterations: not a positive integer: 0"),
    ("autotune", ["--warmup=-1"], "--warmup: not an integer >= 0: -1"),
    ("autotune", ["--confirm_rounds=-2"], "--confirm_rounds: not an integer >= 0: -2"),
    ("model_bench", ["--iterations=-5"], "--iterations: not a positive integer: -5"),
    ("model_bench", ["--warmup=-1"], "--warmup: not an integer >= 0: -1"),
    ("model_bench", ["--num_devices=0"], "--num_devices: not a positive integer: 0"),
    ("matmul_rs_bench", ["--iterations=0"], "--iterations: not a positive integer: 0"),
    ("matmul_rs_bench", ["--warmup=-3"], "--warmup: not an integer >= 0: -3"),
])
def test_a_bad_count_stops_the_script_before_it_runs(script, argv, match):
  with helpers.parsed_script(script, argv) as module, pytest.raises(app.UsageError, match=match):
    module.check_flags()


_CHECKED_FLAGS = ("names", "configs", "variants", "ours", "tags", "variant")


def test_every_script_with_shape_or_variant_flags_checks_them_in_main():
  """A script taking shape or config-variant names defines `check_flags` and its main calls it."""
  import ast  # pylint: disable=g-import-not-at-top
  missing = []
  for path in sorted((helpers.REPO / "experiments").glob("*.py")):
    tree = ast.parse(path.read_text())
    defined = {node.args[0].value for node in ast.walk(tree)
               if isinstance(node, ast.Call) and getattr(node.func, "attr", "").startswith(
                   "DEFINE_") and node.args and isinstance(node.args[0], ast.Constant)}
    if not defined & set(_CHECKED_FLAGS):
      continue
    funcs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    calls = {getattr(n.func, "id", None) for n in ast.walk(funcs["main"])
             if isinstance(n, ast.Call)} if "main" in funcs else set()
    if "check_flags" not in funcs or "check_flags" not in calls:
      missing.append(path.name)
  assert not missing, f"no check_flags() in main: {missing}"


@pytest.mark.parametrize("script", sorted(
    p.stem for p in (helpers.REPO / "experiments").glob("*.py")
    if "\ndef check_flags(" in p.read_text()))
def test_a_script_accepts_its_own_defaults(script):
  # 2026-12-06: overlap_probe.py's default --variants named "direct_f32", a token
  # config_variants never knew, so a run with no --variants stopped at once.
  with helpers.parsed_script(script, []) as module:
    module.check_flags()


@pytest.mark.parametrize("script, message", [
    ("ablate", "ablate.py times the fused Mosaic GPU kernel: it needs a Hopper GPU"),
    ("gemm_core", "gemm_core.py times Mosaic GPU kernels: it needs a Hopper GPU"),
    ("overlap_probe", "overlap_probe.py runs the Mosaic GPU kernel: it needs a Hopper GPU"),
    ("timeline", "timeline.py profiles the Mosaic GPU kernel: it needs a Hopper GPU"),
    ("timer_check", "timer_check.py times with CUPTI: it needs a GPU"),
    ("sustained_load", "sustained_load.py times with CUPTI: it needs a GPU"),
])
def test_a_gpu_script_refuses_a_cpu_in_main(script, message):
  # bench_env.require_gpu / require_cupti, reached through each script's main with its defaults.
  with (helpers.parsed_script(script, []) as module,
        pytest.raises(app.UsageError, match=message)):
    module.main([f"{script}.py"])
