"""Where the fused kernels can run, and the once-per-reason fallback log.

The fused kernels (this package's matmul + reduce-scatter and jax's all-gather matmul) need one
process driving Hopper GPUs (docs/design.md section 7). Everything else runs XLA's composition;
`log_fallback_once` says why, once per distinct reason and process.
"""
from __future__ import annotations

from absl import logging
import jax

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
  return (f"{what} needs one process driving Hopper GPUs; have "
          f"platform={dev.platform!r} {dev.device_kind!r} "
          f"process_count={jax.process_count()}")
