"""Where the fused kernels can run, and the once-per-reason fallback log.

The fused kernels (this package's matmul + reduce-scatter and jax's all-gather matmul) need one
process driving Hopper GPUs (docs/design.md section 7). Everything else runs XLA's composition;
`log_fallback_once` says why, once per distinct reason and process.
"""
from __future__ import annotations

import contextlib
import contextvars

from absl import logging
import jax
from jax._src import mesh as jax_mesh_lib  # get_concrete_mesh: see traced_mesh

# Why a multi-process job never runs the fused kernel: the reason "auto" logs, and the error of
# "fused" (fused.check_mesh).
MULTI_PROCESS_REASON = (
    "fused kernel runs only with one process driving all local GPUs: in multi-process mode "
    "(jax 0.10.2-0.11.x) Mosaic GPU asks NCCL for an NVLink multicast address for every kernel "
    "parameter, and NVLink multicast is off on these machines and must stay off")

# The concrete mesh of the `row_parallel_matmul` call being traced: inside its shard_map only
# the abstract mesh is visible, which has no device order (fused.check_mesh needs it).
_traced_mesh: contextvars.ContextVar = contextvars.ContextVar("pallas_rs_traced_mesh",
                                                              default=None)

# Fallback reasons already logged, so that each distinct reason is logged once
# per process rather than once per trace.
_logged_fallback_reasons: set[str] = set()


def reset_fallback_log() -> None:
  """Forgets the logged fallback reasons (for tests)."""
  _logged_fallback_reasons.clear()


def log_fallback_once(reason: str) -> None:
  """Logs the WARNING "pallas_rs: using the XLA path: <reason>" the first time `reason` is seen.

  A WARNING on every platform, so that it shows by default (absl's logger, which Python's
  logging prints to stderr at WARNING and above), and once per distinct reason and process,
  so that it does not repeat per trace.
  """
  if reason in _logged_fallback_reasons:
    return
  _logged_fallback_reasons.add(reason)
  logging.warning("pallas_rs: using the XLA path: %s", reason)


def on_hopper() -> bool:
  """Whether the fused kernels can run here: one process driving Hopper GPUs."""
  dev = jax.devices()[0]
  return (dev.platform == "gpu"
          and str(getattr(dev, "compute_capability", "")).startswith("9.")
          and jax.process_count() == 1)


def device_kind() -> str:
  """`jax.Device.device_kind` of the first local device (the tuning table's gpu_kind)."""
  return jax.devices()[0].device_kind


def not_hopper_reason(what: str) -> str:
  """Why `what` cannot run here (call when `on_hopper()` is False)."""
  dev = jax.devices()[0]
  reason = (f"{what} needs one process driving Hopper GPUs; have "
            f"platform={dev.platform!r} {dev.device_kind!r} "
            f"process_count={jax.process_count()}")
  if jax.process_count() > 1:
    reason += f" ({MULTI_PROCESS_REASON})"
  return reason


@contextlib.contextmanager
def tracing_on_mesh(mesh: jax.sharding.Mesh):
  """While tracing a shard_map over `mesh` (api.row_parallel_matmul): `traced_mesh` is it."""
  token = _traced_mesh.set(mesh)
  try:
    yield
  finally:
    _traced_mesh.reset(token)


def traced_mesh(abstract_mesh) -> jax.sharding.Mesh | None:
  """The concrete mesh behind `abstract_mesh` (the trace's), if visible: `tracing_on_mesh`'s,
  else the one of `jax.set_mesh`; None otherwise (a bare shard_map under jit shows only the
  abstract mesh) or where the visible mesh is another one (other axis names or sizes)."""
  mesh = _traced_mesh.get()
  if mesh is None:
    get = getattr(jax_mesh_lib, "get_concrete_mesh", None)  # private API: absent = not visible
    mesh = get() if get is not None else None
  if mesh is None or mesh.empty:
    return None
  if (tuple(mesh.axis_names) != tuple(abstract_mesh.axis_names)
      or dict(mesh.shape) != dict(abstract_mesh.shape)):
    return None
  return mesh
