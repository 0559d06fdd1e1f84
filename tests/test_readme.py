"""README.md's usage runs as written on 8 host devices (with the variables it exports), on a
CPU machine and on a GPU machine alike."""
import os
from pathlib import Path
import re
import subprocess
import sys

REPO = Path(__file__).resolve().parents[1]


def _section(text: str, title: str) -> str:
  start = text.index(f"## {title}")
  end = text.find("\n## ", start + 1)
  return text[start:end if end >= 0 else None]


def _run_readme_code(tmp_path, section: str) -> str:
  """The one python block of README section `section`, run with the Usage section's exports
  (XLA_FLAGS, JAX_PLATFORMS) in a fresh interpreter; its stdout."""
  text = (REPO / "README.md").read_text()
  exports = dict(re.findall(r"^export (\w+)=(\S+)", _section(text, "Usage"), re.M))
  assert set(exports) == {"XLA_FLAGS", "JAX_PLATFORMS"}, exports
  (code,) = re.findall(r"```python\n(.*?)```", _section(text, section), re.S)
  env = {k: v for k, v in os.environ.items() if k not in exports}
  env.update(exports)
  return _run_python(code, env, tmp_path)


def _run_python(code: str, env: dict[str, str], cwd) -> str:
  """`code` run in a fresh interpreter with `env` (and PYTHONPATH the repository) in `cwd`; its
  stdout, after checking that it exited 0."""
  env = {**env, "PYTHONPATH": str(REPO)}
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=300, check=False)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  return res.stdout


def test_usage_runs_as_written(tmp_path):
  out = _run_readme_code(tmp_path, "Usage")
  assert out.split("\n")[-2] == "(1024, 512) (1024, 4096) (4096, 512)", out


def test_multi_axis_example_runs_as_written(tmp_path):
  out = _run_readme_code(tmp_path, "Multi-axis meshes")
  assert out.split("\n")[-2] == "(1024, 256) (1024, 2048) (2048, 256) True", out


def test_every_design_citation_resolves():
  design = (REPO / "docs" / "design.md").read_text()
  sections = set(re.findall(r"^## (\d+)\. ", design, re.M))
  assert sections == {str(i) for i in range(1, 9)}
  files = [p for pattern in ("pallas_rs/**/*.py", "experiments/*.py", "tests/*.py", "*.md",
                             "experiments/*.md")
           for p in REPO.glob(pattern)]
  cited = 0
  for path in files:
    text = path.read_text()
    for match in re.finditer(r"design\.md(.{0,40})", text, re.S):
      if path.name == "test_readme.py":
        continue
      cited += 1
      tail = " ".join(match.group(1).split())
      # Every mention is of the repository's docs/design.md; a section cited must exist.
      assert text[max(0, match.start() - 5):match.start()].endswith("docs/"), (path.name, tail)
      ref = re.match(r"section (\d+)", tail)
      assert ref is None or ref.group(1) in sections, (path.name, tail)
  assert cited >= 10


def test_ci_runs_the_readme_test_command_then_the_slow_layer():
  readme = (REPO / "README.md").read_text()
  tests = readme[:readme.index("\n## ")]  # The top: main job and tests.
  (command,) = re.findall(r"&& (python -m pytest[^\n`]*)\n", tests)
  ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
  assert command in ci, (command, ci)
  slow = [line for line in ci if line.startswith("python -m pytest") and "-m slow" in line]
  assert len(slow) == 1 and ci.index(slow[0]) > ci.index(command), ci
  assert "python -m pytest -q tests -m slow" in " ".join(tests.split())


def test_every_cited_module_path_exists():
  """Each `pallas_rs/...` path and `pallas_rs.x.y` module named by the docs and the code exists
  (BUILD_NOTES.md's measurement log keeps the paths of its day)."""
  import importlib  # pylint: disable=g-import-not-at-top
  files = [REPO / "README.md", REPO / "docs" / "design.md", REPO / "experiments" / "README.md",
           *REPO.glob("pallas_rs/**/*.py"), *REPO.glob("experiments/*.py")]
  paths, modules = set(), set()
  for path in files:
    text = path.read_text()
    paths |= set(re.findall(r"\bpallas_rs/[\w/]*\w(?:\.py|\.json|/)?", text))
    modules |= set(re.findall(r"\bpallas_rs(?:\.[a-z_]+)+", text))
  assert len(paths) > 20 and len(modules) > 20, (paths, modules)
  missing = sorted(p for p in paths if not (REPO / p).exists())
  assert not missing, missing
  for dotted in sorted(modules):  # a module, or a name defined in the module before it
    head, _, attr = dotted.rpartition(".")
    try:
      importlib.import_module(dotted)
    except ModuleNotFoundError:
      assert hasattr(importlib.import_module(head), attr), dotted


_COUNT_COLLECTED = r"""
import sys
import pytest

class Count:
  def pytest_collection_finish(self, session):
    # After conftest's modifyitems: its `skip` markers are the gpu tests it skips here.
    slow = gpu = opt_in = fast = 0
    for item in session.items:
      if item.get_closest_marker("slow") is not None:
        slow += 1
        continue
      fast += 1
      if item.get_closest_marker("skip") is not None:
        gpu += 1
      elif any(m.args and m.args[0] for m in item.iter_markers("skipif")):
        opt_in += 1
    print(f"COUNTS {fast} {gpu} {opt_in} {slow}")

sys.exit(pytest.main(["--collect-only", "-q", "--runslow", "-p", "no:cacheprovider", "tests"],
                     plugins=[Count()]))
"""


def test_readme_test_counts_match_the_collection():
  """The README's counts (fast layer: pass and skip on a CPU machine; the slow layer's size) are
  those of the tests as collected: a test added or removed must update them."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PALLAS_RS_", "PYTEST_"))}
  env["JAX_PLATFORMS"] = "cpu"  # the skips as on a CPU machine, on any host
  stdout = _run_python(_COUNT_COLLECTED, env, REPO)
  (line,) = [out for out in stdout.splitlines() if out.startswith("COUNTS ")]
  fast, gpu, opt_in, slow = map(int, line.split()[1:])
  readme = " ".join((REPO / "README.md").read_text().split())
  ((passed, skipped, opt_in_words),) = re.findall(
      r"(\d+) pass, (\d+) skip: the gpu tests and (\w+) opt-in", readme)
  assert (int(passed), int(skipped)) == (fast - gpu - opt_in, gpu + opt_in), (fast, gpu, opt_in)
  assert opt_in_words == {1: "one", 2: "two", 3: "three"}.get(opt_in), (opt_in_words, opt_in)
  (slow_readme,) = re.findall(r"further cases of paths the fast layer checks; (\d+) tests", readme)
  assert int(slow_readme) == slow, (slow_readme, slow)
