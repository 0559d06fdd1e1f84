"""Environment and output helpers shared by the experiment scripts.

Used by matmul_rs_bench.py, model_bench.py and autotune.py. Defines no absl
flags (importing it registers nothing), and imports no jax at module level:
smoke mode's XLA_FLAGS must be set (`configure_environment`) before jax is
first imported.
"""
from __future__ import annotations

from collections.abc import Sequence
import datetime
import json
import math
import os
from pathlib import Path
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from absl import app
from absl import logging
import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODES = ("auto", "smoke", "single_gpu", "multi_gpu")
SMOKE_DEVICES = 8
FORCE_DEVICES_FLAG = "--xla_force_host_platform_device_count"
NO_CLAIMS = "host_wall_clock: smoke only, no performance claims"
# Where every script writes when --out names no path: git-ignored, so that smoke and trial runs
# stay out of the curated results (experiments/results/ is written only by naming a path there
# with --out) and do not make the next run record git_dirty.
OUT_DIR = REPO / "experiments" / "out"
OUT_DIR_NAME = "experiments/out/"


def default_out(name: str) -> Path:
  """OUT_DIR / name: a script's output path when --out is not given."""
  return OUT_DIR / name


def utc_stamp() -> str:
  """YYYYmmdd-HHMMSS (UTC), for default output names."""
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")


# ---------------------------------------------------------------------------
# Environment (before jax is imported).
# ---------------------------------------------------------------------------


def gpu_count_nvidia_smi() -> int:
  if shutil.which("nvidia-smi") is None:
    return 0
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                         timeout=30, check=False).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def configure_environment(mode: str, environ=os.environ) -> str:
  """Sets process environment for `mode` and returns the resolved mode.

  smoke: forces SMOKE_DEVICES host devices through XLA_FLAGS when jax is not
  imported yet (tests/conftest.py does the same before importing jax); if jax
  is already imported, the device count is checked instead.
  multi_gpu: NCCL_NVLS_ENABLE defaults to 0; any other value is refused
  (NVLink multicast must never be used, docs/design.md section 7).
  """
  if mode not in MODES:
    raise ValueError(f"{mode=} must be one of {MODES}")
  if mode == "auto":
    gpus = gpu_count_nvidia_smi()
    mode = "multi_gpu" if gpus >= 2 else "single_gpu" if gpus == 1 else "smoke"
    logging.info("--mode=auto: %d GPU(s) by nvidia-smi -> %s", gpus, mode)
  if mode == "smoke":
    if "jax" not in sys.modules:
      _force_host_devices(environ)
      environ.setdefault("JAX_PLATFORMS", "cpu")
  if mode == "multi_gpu":
    nvls = environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if nvls != "0":
      raise app.UsageError(
          f"NCCL_NVLS_ENABLE={nvls!r}: NVLink multicast must stay off for the "
          "baselines; unset it or set it to 0")
  return mode


def _force_host_devices(environ) -> None:
  """SMOKE_DEVICES host devices through XLA_FLAGS, unless it names a count already."""
  xla_flags = environ.get("XLA_FLAGS", "")
  if FORCE_DEVICES_FLAG not in xla_flags:
    environ["XLA_FLAGS"] = f"{xla_flags} {FORCE_DEVICES_FLAG}={SMOKE_DEVICES}".strip()


def use_host_devices() -> None:
  """jax's devices become SMOKE_DEVICES host devices, on any machine: what a --lower_only run
  lowers on (a CUDA export needs no GPU, and a machine with fewer GPUs than the mesh still
  lowers). jax may be imported, but its backends must not have started (under pytest they
  have, on the conftest's 8 host devices)."""
  import jax  # pylint: disable=g-import-not-at-top
  _force_host_devices(os.environ)
  jax.config.update("jax_platforms", "cpu")


def run_cmd(cmd: Sequence[str]) -> str | None:
  """stdout of `cmd` run in the repository root, or None if it failed."""
  try:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30,
                         check=False, cwd=REPO)
  except (OSError, subprocess.SubprocessError):
    return None
  return res.stdout.strip() if res.returncode == 0 else None


def working_tree_id(repo: Path = REPO) -> str | None:
  """The git tree id of the files as they are (tracked and untracked, not ignored): what
  `git rev-parse <commit>^{tree}` gives for the commit holding exactly these files, so a
  record names the code that ran even where HEAD lags the tree (a device copy). Built in a
  throwaway index; None where git cannot."""
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
    try:
      for cmd in (["git", "add", "-A"], ["git", "write-tree"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False,
                             cwd=repo, env=env)
        if res.returncode:
          return None
    except (OSError, subprocess.SubprocessError):
      return None
  return res.stdout.strip() or None


def environment_block(argv: Sequence[str]) -> dict[str, Any]:
  """jax/jaxlib, backend, devices, driver, XLA/NCCL env, git, command, date."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  smi = None
  if shutil.which("nvidia-smi"):
    smi = run_cmd(["nvidia-smi", "--query-gpu=name,driver_version",
                   "--format=csv,noheader"])
  driver = smi.splitlines()[0].split(",")[-1].strip() if smi else None
  commit = run_cmd(["git", "rev-parse", "HEAD"])
  status = run_cmd(["git", "status", "--porcelain"])
  return {
      "jax_version": jax.__version__,
      "jaxlib_version": jaxlib.__version__,
      "python": sys.version.split()[0],
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "gpu_names": smi.splitlines() if smi else None,
      "driver_version": driver,
      "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
      "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
      "nccl_env": {k: v for k, v in sorted(os.environ.items())
                   if k.startswith("NCCL_")},
      "git_commit": commit,
      "git_dirty": bool(status) if status is not None else None,
      "git_tree": working_tree_id(),
      # How CUPTI orders kernel records across GPUs (pallas_rs.bench.cupti.record_layout).
      "cupti_record_layout": _record_layout(jax),
      "command": " ".join(shlex.quote(a) for a in [sys.executable, *argv]),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
  }


def _record_layout(jax) -> str | None:
  if jax.default_backend() != "gpu" or len(jax.local_devices()) < 2:
    return None
  from pallas_rs.bench import cupti  # pylint: disable=g-import-not-at-top
  return cupti.record_layout()


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------


def _finite_or_none(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def sanitize(obj):
  """JSON-ready copy: numpy scalars to Python, tuples to lists, inf/nan to None."""
  if isinstance(obj, dict):
    return {k: sanitize(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [sanitize(v) for v in obj]
  if isinstance(obj, (np.floating,)):
    obj = float(obj)
  if isinstance(obj, (np.integer,)):
    obj = int(obj)
  return _finite_or_none(obj)


def write_json(path: Path, obj, *, allow_nan: bool = True) -> None:
  """Writes `obj` (indent 1, trailing newline) atomically, making parents."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1, allow_nan=allow_nan) + "\n")
  tmp.replace(path)


# The seed's error rule (docs/design.md section 2): the fused output's max relative error at
# most this many times the unfused path's on the same inputs.
MAX_ERROR_RATIO = 1.1


def require_gpu(script: str, what: str) -> None:
  """UsageError unless jax's first device is a GPU, for scripts that run a Mosaic GPU kernel;
  `what` says what `script` does with it. Imports jax: call it after `configure_environment`."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.devices()[0].platform != "gpu":
    raise app.UsageError(f"{script} {what}: it needs a Hopper GPU")


def require_cupti(script: str) -> None:
  """UsageError unless the timer resolves to CUPTI: for scripts that measure the GPU's timer or
  clock, whose host-timer numbers would mean nothing. Imports jax: call it after
  `configure_environment`."""
  from pallas_rs.bench import timing  # pylint: disable=g-import-not-at-top
  if timing.resolve_timer() != "cupti":
    raise app.UsageError(f"{script} times with CUPTI: it needs a GPU")


def rule_holds(err: float, err_unfused: float, max_ratio: float = MAX_ERROR_RATIO,
               slack: float = 0.0) -> bool:
  """The error rule (`slack`: an absolute allowance, for tuners that compare tiny errors);
  False where either error is NaN (a NaN output is never correct)."""
  return bool(err <= max_ratio * err_unfused + slack)


def worse(worst: float, ratio: float) -> float:
  """The larger of two error ratios for a running worst; a NaN (a NaN error) is the worst
  and stays (max() would pass it over)."""
  return worst if math.isnan(worst) or ratio <= worst else ratio


def fmt(value, spec: str = ".2f") -> str:
  """`value` formatted with `spec` for a table cell; "-" for None."""
  return "-" if value is None else format(value, spec)
