"""Public surface, the shape table and the numpy reference helpers."""
import numpy as np
import pytest

import pallas_rs
from pallas_rs import reference
from pallas_rs.bench import shapes


def test_public_api():
  for name in pallas_rs.__all__:
    assert getattr(pallas_rs, name) is not None, name
  assert pallas_rs.reference_matmul_reduce_scatter is reference.matmul_reduce_scatter
  assert pallas_rs.shapes is shapes
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    pallas_rs.nope  # pylint: disable=pointless-statement


def test_seed_cases_match_design():
  assert len(shapes.SEED_CASES) == 16
  nk = {(c.n, c.k) for c in shapes.SEED_CASES}
  assert nk == {(8192, 8192), (8192, 28672), (6144, 6144), (6144, 16384)}
  assert {c.m for c in shapes.SEED_CASES} == {512, 2048, 8192, 32768}
  for c in shapes.SEED_CASES:
    assert c.num_devices == 8 and c.dtype == "bfloat16" and "seed" in c.tags
    assert c.k % c.num_devices == 0 and c.m % c.num_devices == 0
  c = shapes.by_name("llama70b_down_proj_m512")
  assert (c.m, c.n, c.k, c.k_shard, c.m_shard) == (512, 8192, 28672, 3584, 64)
  assert "llama70b" in c.tags and "down_proj" in c.tags


def test_ci_cases_are_small_and_legal():
  ci = shapes.select("ci")
  assert ci == shapes.CI_CASES
  assert {c.num_devices for c in ci} == {2, 4, 8}
  assert {c.dtype for c in ci} == {"bfloat16", "float32"}
  assert any(c.m == c.num_devices for c in ci)
  assert any(c.n & (c.n - 1) for c in ci)  # A non-power-of-two n.
  for c in ci:
    assert c.k % c.num_devices == 0 and c.m % c.num_devices == 0, c
    assert c.m * c.k * c.n <= 2**26, c  # Keeps CPU runs fast.


def test_select_and_by_name():
  assert len(shapes.select(["seed", "mixtral8x22b"])) == 8
  assert shapes.select("seed", names=["llama70b_o_proj_m512"]) == (
      shapes.by_name("llama70b_o_proj_m512"),)
  assert shapes.select(names=[]) == ()
  assert shapes.select() == shapes.ALL_CASES
  with pytest.raises(KeyError, match="unknown case name='nope'"):
    shapes.by_name("nope")
  with pytest.raises(KeyError, match="nope"):
    shapes.select(names=["nope"])


def test_custom_case_and_validation():
  c = shapes.custom_case(1024, 384, 2048, 4)
  assert (c.name, c.k_shard, c.m_shard, c.n_shard) == (
      "custom_m1024_n384_k2048_d4", 512, 256, 96)
  assert c.tags == frozenset({"custom"})
  assert c.with_num_devices(2).name == "custom_m1024_n384_k2048_d4_d2"
  with pytest.raises(ValueError, match="m=0 must be a positive int"):
    shapes.Case("bad", m=0, n=1, k=1, num_devices=1)


def test_numpy_reference_both_dimensions():
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((4, 8, 3))
  ws = rng.standard_normal((4, 3, 12))
  full = sum(xs[d] @ ws[d] for d in range(4))
  out0 = reference.numpy_reference(xs, ws, 0)
  out1 = reference.numpy_reference(xs, ws, 1)
  assert out0.shape == (4, 2, 12) and out1.shape == (4, 8, 3)
  np.testing.assert_allclose(out0.reshape(8, 12), full)
  np.testing.assert_allclose(np.concatenate(list(out1), axis=1), full)
  with pytest.raises(ValueError, match="not divisible"):
    reference.numpy_reference(xs[:, :6], ws, 0)
  with pytest.raises(ValueError, match="expected xs"):
    reference.numpy_reference(xs[0], ws, 0)


def test_max_rel_error():
  ref = np.array([[1.0, -4.0], [2.0, 0.0]])
  assert reference.max_rel_error(ref, ref) == 0.0
  assert reference.max_rel_error(ref + [[0, 0], [0, 0.5]], ref) == 0.125
  assert reference.max_rel_error(np.zeros(3), np.zeros(3)) == 0.0
  assert reference.max_rel_error(np.ones(3), np.zeros(3)) == float("inf")
  with pytest.raises(ValueError, match="shape"):
    reference.max_rel_error(np.ones(2), np.ones(3))


def test_max_rel_error_on_device_is_the_same_figure():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ref = np.array([[1.0, -4.0], [2.0, 0.0]], np.float32)
  on_device = jax.jit(reference.max_rel_error_on_device)
  for out, want in ((ref, 0.0), (ref + [[0, 0], [0, 0.5]], 0.125)):
    assert float(on_device(out, ref)) == want == reference.max_rel_error(out, ref)
  assert float(on_device(np.zeros(3), np.zeros(3))) == 0.0
  assert float(on_device(np.ones(3), np.zeros(3))) == float("inf")
  out = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.bfloat16)
  ref = np.random.default_rng(1).standard_normal((16, 8))
  assert float(on_device(out, ref)) == pytest.approx(reference.max_rel_error(out, ref),
                                                     rel=1e-6)
  with pytest.raises(ValueError, match="shape"):
    reference.max_rel_error_on_device(np.ones(2), np.ones(3))


def test_max_rel_error_on_device_keeps_a_nan_of_a_sharded_output():
  """A max over a sharded array dropped a NaN on one shard (8 CPU devices): the error was 0."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((8,), ("x",))
  ref = np.ones((64, 4), np.float32)
  for row in (3, 60):
    out = ref.copy()
    out[row, 1] = np.nan
    out = jax.device_put(out, NamedSharding(mesh, P("x")))
    assert np.isnan(float(jax.jit(reference.max_rel_error_on_device)(out, ref))), row
    assert np.isnan(reference.max_rel_error(out, ref))


def _import_graph():
  """{module: modules of pallas_rs it imports (lazy imports included)}, by dotted name relative
  to the package ("api", "kernel.fused", "tuning" for tuning/__init__.py), and their sizes."""
  import re  # pylint: disable=g-import-not-at-top
  from pathlib import Path  # pylint: disable=g-import-not-at-top
  root = Path(pallas_rs.__file__).parent

  def name_of(path):
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

  modules = {name_of(p): p for p in root.rglob("*.py")}
  graph, sizes = {}, {}
  for name, path in modules.items():
    text = path.read_text()
    sizes[name] = len(text.splitlines())
    deps = set()
    for pkg, names in re.findall(r"from pallas_rs((?:\.\w+)*) import \(?([\w, ]+)", text):
      pkg = pkg.lstrip(".")
      for item in filter(None, (n.split(" as ")[0].strip() for n in names.split(","))):
        full = f"{pkg}.{item}" if pkg else item
        deps.add(full if full in modules else pkg)
    graph[name] = deps - {name, ""}
  return graph, sizes


def test_imports_only_go_down_and_modules_stay_small():
  """No import circle among pallas_rs modules (lazy imports included); none over 450 lines;
  the layers import only downwards: kernel/ <- tuning/ <- the user layer (this folder) <- bench/.
  `platform` (which GPU, the fallback log) serves them all."""
  graph, sizes = _import_graph()
  assert {"api", "kernel.fused", "tuning.gate", "bench.testing"} <= set(graph)
  for name, size in sizes.items():
    assert size <= 450, (name, size)
  graph.pop("")  # pallas_rs/__init__.py: re-exports, submodules on first use
  done, active = set(), []

  def visit(name):
    assert name not in active, f"import circle: {' -> '.join(active + [name])}"
    if name in done or name not in graph:
      return
    active.append(name)
    for dep in sorted(graph[name]):
      visit(dep)
    active.pop()
    done.add(name)

  for name in sorted(graph):
    visit(name)

  def layer(name):
    return name.split(".")[0] if name.split(".")[0] in ("kernel", "tuning", "bench") else "user"

  allowed = {"kernel": {"kernel"}, "tuning": {"kernel", "tuning"},
             "user": {"kernel", "tuning", "user"}, "bench": {"kernel", "tuning", "user", "bench"}}
  for name, deps in graph.items():
    for dep in deps:
      assert dep == "platform" or layer(dep) in allowed[layer(name)], (
          f"{name} ({layer(name)} layer) imports {dep} ({layer(dep)} layer)")


def test_importing_the_ops_loads_no_test_or_benchmark_helper():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys, pallas_rs\n"
          "from pallas_rs import model\n"
          "from pallas_rs.tuning import gate, candidates\n"
          "from pallas_rs.kernel import fused\n"
          "print(sorted(m for m in sys.modules if m.startswith('pallas_rs.bench')))\n"
          "print(pallas_rs.shapes.__name__)\n")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.split("\n")[:2] == ["[]", "pallas_rs.bench.shapes"], res.stdout


def test_the_packaged_table_ships_with_the_package():
  """pyproject's packages and package-data name every subpackage and the table."""
  import tomllib  # pylint: disable=g-import-not-at-top
  from pathlib import Path  # pylint: disable=g-import-not-at-top
  root = Path(pallas_rs.__file__).parent
  pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
  packages = {".".join(p.relative_to(root.parent).parts) for p in (root, *root.rglob("*"))
              if (p / "__init__.py").is_file()}
  assert set(pyproject["packages"]) == packages
  (pattern,) = pyproject["package-data"]["pallas_rs.tuning"]
  assert [p.name for p in (root / "tuning").glob(pattern)] == ["tuning_table.json"]
  assert pallas_rs.tuning.PACKAGED_TABLE_PATH == root / "tuning" / "data" / "tuning_table.json"
