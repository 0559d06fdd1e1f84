"""Shared test helpers: meshes, tolerances, comparisons.

Conventions (also used by the kernel tests):
  * A `pallas_rs.shapes.Case` describes the global problem; its operands come from
    `pallas_rs.bench.testing` (`make_inputs(case, seed)`: stacked per-device xs [D, m, k_shard],
    ws [D, k_shard, n] and the matching global x [m, k], w [k, n], x[:, d*k_shard:(d+1)*k_shard]
    being xs[d]; `put_operands` places them on a mesh).
  * Device d's x is scaled by 1 + d / D, so a missing, duplicated or swapped rank changes the
    result.
  * `make_mesh(D)` uses jax.devices()[:D] in order (row-major device ids).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path
import re
import subprocess
import sys

import jax
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

from pallas_rs import reference
from pallas_rs.bench import testing

AXIS = "x"

# Unit roundoff (half an ulp at 1.0) of each dtype.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 2.0**-24}


# "ci" cases (pallas_rs.bench.shapes) whose parametrized forward and VJP tests are in the slow
# layer (tests/conftest.py): three of the four scaled-down seed projections at D = 8, the path
# of the fourth (ci_llama70b_o_proj_d8, fast) at other n and k.
SLOW_CI_CASES = frozenset({"ci_llama70b_down_proj_d8", "ci_mixtral8x22b_o_proj_d8",
                           "ci_mixtral8x22b_w2_d8"})


def ci_marks(case):
  """The pytest marks of a "ci" case's forward and VJP tests: slow for SLOW_CI_CASES."""
  return pytest.mark.slow if case.name in SLOW_CI_CASES else ()


def np_dtype(dtype) -> np.dtype:
  """numpy dtype for a name ("bfloat16" uses ml_dtypes)."""
  return np.dtype(ml_dtypes.bfloat16 if str(dtype) == "bfloat16" else dtype)


def hopper_devices() -> list:
  """Local Hopper (compute capability 9.x) GPUs, or [] (no GPU backend)."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return []
  return [d for d in devices
          if str(getattr(d, "compute_capability", "")).startswith("9.")]


def make_mesh(num_devices: int, axis_name: str = AXIS, devices=None
              ) -> jax.sharding.Mesh:
  """1-D mesh over the first `num_devices` devices; skips the test if too few."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < num_devices:
    pytest.skip(f"needs {num_devices} devices, have {len(devices)} "
                f"{devices[0].platform} (JAX_PLATFORMS=cpu forces 8 host devices)")
  return jax.make_mesh((num_devices,), (axis_name,),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices[:num_devices])


def random_per_device(shape, num_devices: int, dtype, seed: int) -> np.ndarray:
  """[D, *shape] normals scaled by (d + 1) / D (e.g. cotangents dy)."""
  rng = np.random.default_rng(seed)
  scale = ((np.arange(num_devices) + 1) / num_devices).reshape(
      (num_devices,) + (1,) * len(shape))
  return (rng.standard_normal((num_devices, *shape)) * scale).astype(
      np_dtype(dtype))


def reference_output(inputs: testing.Inputs, scatter_dimension: int = 0) -> np.ndarray:
  """float64 per-device expected outputs [D, ...] (see reference.numpy_reference)."""
  return reference.numpy_reference(inputs.xs, inputs.ws, scatter_dimension)


def shard_spec(scatter_dimension: int, axis_name: str = AXIS) -> P:
  return P(axis_name, None) if scatter_dimension == 0 else P(None, axis_name)


@functools.lru_cache(maxsize=None)
def shard_mapped(fn, mesh, axis_name: str = AXIS, scatter_dimension: int = 0):
  """jit(shard_map(fn)) for a per-device `fn(x, w) -> out` (cached).

  In specs P(None, axis), P(axis, None); out spec along `scatter_dimension`.
  `fn` must be hashable (a module-level function or functools.partial).
  """
  return jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=(P(None, axis_name), P(axis_name, None)),
      out_specs=shard_spec(scatter_dimension, axis_name), check_vma=False))


def per_device_shards(out: jax.Array, mesh) -> np.ndarray:
  """[D, ...] numpy stack of `out`'s shards, in mesh device order.

  shards[i] is the block held by mesh.devices[i]; comparing it with the
  reference's row i checks that chunk i landed on device i.
  """
  by_device = {s.device: s for s in out.addressable_shards}
  return np.stack([np.asarray(by_device[dev].data)
                   for dev in mesh.devices.flat])


def forward_tolerance(dtype, num_devices: int) -> float:
  """Allowed max|out - ref| / max|ref| of the forward pass.

  The XLA path rounds each device's fp32 partial product to `dtype`, then adds
  the D partials, possibly rounding after each addition (NCCL does): D + 1
  roundings of at most u (unit roundoff) relative each. With `testing.make_inputs`'
  data every partial and partial sum is at most about max|ref|, so
  (D + 1) * u bounds the normwise error; measured errors are 0.1-0.4 of it,
  and a wrong chunk, rank or scaling is an O(1) error. f32 adds the error of
  the k_shard-long fp32 accumulation, covered by a floor of 1e-5.
  """
  u = UNIT_ROUNDOFF[str(dtype)]
  return max((num_devices + 1) * u, 1e-5)


def grad_tolerance(dtype) -> float:
  """Allowed normwise error of dx and dw against a float64 analytic reference.

  Each gradient is one matmul accumulated in fp32 and rounded once to `dtype`
  (dy is exact: it is an input): error <= u * |g| + fp32 accumulation, so
  2 * u (one ulp) normwise, with a floor of 1e-5 for f32.
  """
  return max(2 * UNIT_ROUNDOFF[str(dtype)], 1e-5)


def assert_close(out, ref, *, tol: float, name: str = "") -> None:
  """Asserts max|out - ref| <= tol * max|ref|, element by element.

  On failure reports the normwise max and RMS relative errors and the first
  mismatched coordinates.
  """
  out64 = np.asarray(out).astype(np.float64)
  ref64 = np.asarray(ref).astype(np.float64)
  assert out64.shape == ref64.shape, (name, out64.shape, ref64.shape)
  scale = float(np.max(np.abs(ref64), initial=0.0)) or 1.0
  err = np.abs(out64 - ref64)
  bad = np.argwhere(err > tol * scale)
  if bad.size:
    rms = float(np.sqrt(np.mean(err**2))) / scale
    first = [(tuple(int(i) for i in idx), float(out64[tuple(idx)]),
              float(ref64[tuple(idx)])) for idx in bad[:5]]
    raise AssertionError(
        f"{name}: {len(bad)}/{err.size} elements off by more than "
        f"{tol=} * max|ref|={scale:.4g}; max rel err="
        f"{float(err.max()) / scale:.3g}, rms rel err={rms:.3g}; first "
        f"(index, out, ref): {first}")


def assert_one_bf16_rounding(out, x, w, rows=slice(None)) -> None:
  """Asserts `out` (bf16) is x[rows] @ w in fp64 up to one bf16 rounding of an fp32-accumulated
  product, every element (|err| <= 2^-8 |value|, + fp32 noise), and that no element is NaN (an
  output tile never written, with uninitialised memory poisoned to NaN)."""
  out = np.asarray(out).astype(np.float32)
  ref = (np.asarray(x, np.float32).astype(np.float64)[rows]
         @ np.asarray(w, np.float32).astype(np.float64))
  assert not np.isnan(out).any(), "an output tile was never written"
  assert np.max(np.abs(out - ref) / (np.abs(ref) + 1e-3 * np.abs(ref).max())) <= 2.0**-8 * 1.01


def assert_same_bits(want, got, name="") -> None:
  """Asserts two bf16 arrays equal bit for bit; on failure reports how many elements differ
  and the first flat indices."""
  want, got = np.asarray(want), np.asarray(got)
  assert want.shape == got.shape, (name, want.shape, got.shape)
  mismatch = np.flatnonzero(want.view(np.uint16) != got.view(np.uint16))
  assert mismatch.size == 0, (name, mismatch.size, mismatch[:8])


def record_kernel_modules(monkeypatch) -> list[str]:
  """Patches Mosaic GPU's lowering rule to append each kernel module it lowers to the list
  returned (asm without debug locations). jax 0.11.2 numbers the kernels that one process
  lowers (the module header's `mosaic_gpu.dump_basename = "<name>_<n>"`): the number is
  dropped, so that two lowerings of the same kernel compare equal on both jax versions."""
  from jax.experimental.mosaic.gpu import core as mgpu_core  # pylint: disable=g-import-not-at-top
  modules = []
  rule = mgpu_core._mosaic_gpu_lowering_rule  # pylint: disable=protected-access

  def recording(ctx, *args, module, **kw):
    header, _, body = module.operation.get_asm(enable_debug_info=False).partition("\n")
    modules.append(re.sub(r'(dump_basename = "[^"]*)_[0-9]+"', r'\1"', header) + "\n" + body)
    return rule(ctx, *args, module=module, **kw)

  monkeypatch.setattr(mgpu_core, "_mosaic_gpu_lowering_rule", recording)
  return modules


REPO = Path(__file__).resolve().parents[1]

_STAND_IN_DRIVER = """
import importlib.util, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {exp!r})
from absl import app
from pallas_rs.kernel import fused
from pallas_rs import reference
{stand_ins}
spec = importlib.util.spec_from_file_location("script", {script!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
{after_load}
app.run(mod.main)
"""


def run_script_with_stand_ins(script: str, args, *, stand_ins: str, after_load: str = "",
                              timeout: int = 600) -> subprocess.CompletedProcess:
  """Runs experiments/`script` with `args` in a subprocess on 8 forced CPU devices.

  `stand_ins` (Python source) runs first, with `fused` and `reference` imported: it replaces
  the kernel entry points, which cannot run on a CPU, so that the script's own plumbing is
  what the test checks; `after_load` runs with the script loaded as `mod` (e.g. to lift its
  GPU check)."""
  code = _STAND_IN_DRIVER.format(
      repo=str(REPO), exp=str(REPO / "experiments"), script=str(REPO / "experiments" / script),
      stand_ins=stand_ins, after_load=after_load)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                        timeout=timeout, env=env, cwd=REPO)


def load_script(name: str):
  """experiments/`name`.py as a module, loaded once per process (it defines absl flags)."""
  if name not in sys.modules:
    if str(REPO / "experiments") not in sys.path:
      sys.path.insert(0, str(REPO / "experiments"))
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


@contextlib.contextmanager
def script(name: str):
  """experiments/`name`.py loaded (`load_script`) for the block, then forgotten."""
  try:
    yield load_script(name)
  finally:
    forget_scripts(name)


@contextlib.contextmanager
def parsed_script(name: str, argv):
  """experiments/`name`.py loaded with its absl flags parsed from `argv` (arguments after the
  program name); yields the module. Unloaded afterwards: other scripts define the same flags."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  module = load_script(name)
  try:
    flags.FLAGS.unparse_flags()
    rest = flags.FLAGS([f"{name}.py", *argv])
    assert rest == [f"{name}.py"], f"{name} left arguments {rest[1:]}"
    yield module
  finally:
    flags.FLAGS.unparse_flags()
    forget_scripts(name)


def forget_scripts(*names: str) -> None:
  """Unloads scripts loaded by `load_script` and removes their absl flags, so that a later test
  file can load another script that defines the same flag names."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  for name in names:
    if sys.modules.pop(name, None) is not None:
      for flag in flags.FLAGS.get_flags_for_module(name):
        delattr(flags.FLAGS, flag.name)
