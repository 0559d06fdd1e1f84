"""pytest setup: 8 forced host devices, skips for the gpu/multigpu markers, the slow layer.

Every test not marked gpu/multigpu (the CPU layer) needs jax's CPU backend and its 8 forced
host devices: where jax defaults to a GPU they are skipped, saying to run them with
JAX_PLATFORMS=cpu (41 of them failed on one H200's backend: BUILD_NOTES 2026-12-02,
twenty-seventh session); the gpu/multigpu tests need the GPU backend.

Tests marked `slow` (the CUDA lowering of every seed shape at D = 8 and of every tuning-table
config, the experiment scripts' end-to-end runs, the larger-D numerics sweeps, the pytest
selections of experiments/run_multi_gpu.sh, and the further cases of a path that a fast test
already checks) are deselected unless `--runslow` or PALLAS_RS_RUNSLOW=1 (or `-m` names the
marker): `python -m pytest -q tests -n 2` takes 2.5 to ~5 minutes on 2 CPU cores (README);
`python -m pytest -q tests -m slow -n 2` runs the slow layer alone, `--runslow` everything; CI
(.ci/run) runs both layers (each on two processes).

XLA_FLAGS must be set before jax is first imported, hence at the top of the
conftest (pytest imports it before any test module).
"""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

import helpers  # pylint: disable=g-import-not-at-top,wrong-import-position


SLOW_ENV = "PALLAS_RS_RUNSLOW"


def pytest_addoption(parser):
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run the tests marked slow (deselected by default; CI runs them; "
                   f"or set {SLOW_ENV}=1)")


def _run_slow(config) -> bool:
  """Whether the slow tests stay selected: --runslow, PALLAS_RS_RUNSLOW=1, or a -m expression
  that names the marker (`-m slow`: the slow layer alone; `-m "not slow"`)."""
  return (config.getoption("--runslow") or os.environ.get(SLOW_ENV, "") not in ("", "0")
          or "slow" in (config.getoption("markexpr", "") or ""))


def pytest_report_header(config):
  if _run_slow(config):
    return "pallas_rs: slow tests included"
  return "pallas_rs: slow tests deselected (--runslow to include them)"


def pytest_collection_modifyitems(config, items):
  if not _run_slow(config):
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
      config.hook.pytest_deselected(items=slow)
      items[:] = [item for item in items if item.get_closest_marker("slow") is None]
  num_hopper = len(helpers.hopper_devices())
  skip_gpu = pytest.mark.skip(reason="needs a Hopper GPU (sm_90); none found")
  skip_multigpu = pytest.mark.skip(
      reason=f"needs >= 2 Hopper GPUs; found {num_hopper}")
  backend = jax.default_backend()
  skip_cpu_layer = pytest.mark.skip(
      reason=f"the CPU layer needs the 8 forced host devices; jax defaults to {backend} here: "
      "run it with JAX_PLATFORMS=cpu")
  for item in items:
    if backend != "cpu" and "gpu" not in item.keywords and "multigpu" not in item.keywords:
      item.add_marker(skip_cpu_layer)
    if "gpu" in item.keywords and num_hopper < 1:
      item.add_marker(skip_gpu)
    if "multigpu" in item.keywords and num_hopper < 2:
      item.add_marker(skip_multigpu)
