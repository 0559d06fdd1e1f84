"""pytest setup: 8 forced host devices, and skips for the gpu/multigpu markers.

XLA_FLAGS must be set before jax is first imported, hence at the top of the
conftest (pytest imports it before any test module).
"""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

import helpers  # pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_collection_modifyitems(config, items):
  del config
  num_hopper = len(helpers.hopper_devices())
  skip_gpu = pytest.mark.skip(reason="needs a Hopper GPU (sm_90); none found")
  skip_multigpu = pytest.mark.skip(
      reason=f"needs >= 2 Hopper GPUs; found {num_hopper}")
  for item in items:
    if "gpu" in item.keywords and num_hopper < 1:
      item.add_marker(skip_gpu)
    if "multigpu" in item.keywords and num_hopper < 2:
      item.add_marker(skip_multigpu)
