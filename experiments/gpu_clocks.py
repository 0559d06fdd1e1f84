"""The GPUs' SM clock, power and clock-event reasons while a block of work runs: `nvidia-smi`
sampled in the background (read only; nothing about the GPU is set).

Why: long CUPTI sessions of calls back to back ran 5-17% slower than short ones, with the SM
clock down under the power cap (one H100, BUILD_NOTES 2026-12-05, eighty-fourth session: median
1575 against 1965 MHz), so a timing means little without the clock it ran at.

  with gpu_clocks.sampled() as log:
    ...                                   # timed work
  log.summary()                           # per GPU: busy samples, SM clock, power, reasons
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
import statistics
import subprocess
import tempfile

# nvidia-smi's clocks_event_reasons bits that lower the clock under load.
REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
           0x80: "hw_power_brake"}
_FIELDS = ("index", "timestamp", "clocks.sm", "power.draw", "utilization.gpu")
# Renamed from clocks_throttle_reasons.active in newer drivers; either is asked for.
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
BUSY_PERCENT = 50


@dataclasses.dataclass(frozen=True)
class Sample:
  gpu: int
  timestamp: str
  sm_mhz: float
  power_w: float
  utilization: float
  reasons: int


@dataclasses.dataclass
class ClockLog:
  """What `sampled` or a `Sampler` saw: `samples` once the block has ended, or `note` saying
  why there are none."""
  samples: list[Sample] = dataclasses.field(default_factory=list)
  note: str | None = None

  def result(self) -> dict | str | None:
    """What a JSON record keeps: the `summary`, or the `note` saying why there is none."""
    return self.summary() or self.note

  def summary(self, busy_percent: int = BUSY_PERCENT) -> dict | None:
    """Per GPU (str index): samples, busy samples (utilization >= `busy_percent`), and over
    the busy ones the SM clock's median and min (MHz), the median power (W) and how many
    carried each clock-lowering reason. None where nothing was sampled."""
    if not self.samples:
      return None
    out = {}
    for gpu in sorted({s.gpu for s in self.samples}):
      mine = [s for s in self.samples if s.gpu == gpu]
      busy = [s for s in mine if s.utilization >= busy_percent]
      entry = {"samples": len(mine), "busy_samples": len(busy)}
      if busy:
        clocks = [s.sm_mhz for s in busy]
        entry.update(sm_mhz_median=statistics.median(clocks), sm_mhz_min=min(clocks),
                     power_w_median=statistics.median(s.power_w for s in busy),
                     reasons={name: sum(1 for s in busy if s.reasons & bit)
                              for bit, name in REASONS.items()})
      out[str(gpu)] = entry
    return out


def busy_mhz(summary: dict | str | None) -> str:
  """A table cell: each GPU's busy median SM clock, MHz ("1965" or "1965, 1950"); "-" where
  nothing busy was sampled (a `ClockLog.note` or None)."""
  if not isinstance(summary, dict):
    return "-"
  cells = [f"{e['sm_mhz_median']:.0f}" for e in summary.values() if "sm_mhz_median" in e]
  return ", ".join(cells) or "-"


def parse(text: str) -> list[Sample]:
  """Samples from nvidia-smi's `--format=csv,noheader,nounits` lines of `_FIELDS` + reasons;
  lines that do not parse (a field "[N/A]", a cut last line) are skipped."""
  samples = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != len(_FIELDS) + 1:
      continue
    try:
      samples.append(Sample(gpu=int(cells[0]), timestamp=cells[1], sm_mhz=float(cells[2]),
                            power_w=float(cells[3]), utilization=float(cells[4]),
                            reasons=int(cells[5], 16)))
    except ValueError:
      continue
  return samples


@functools.cache  # One probe per nvidia-smi path and process, not one per sampled block.
def _query(smi: str) -> list[str] | None:
  """The nvidia-smi command line with the reasons field this driver knows, or None."""
  for reasons in _REASON_FIELDS:
    cmd = [smi, f"--query-gpu={','.join(_FIELDS + (reasons,))}",
           "--format=csv,noheader,nounits"]
    try:
      if subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode == 0:
        return cmd
    except (OSError, subprocess.SubprocessError):
      return None
  return None


class Sampler:
  """nvidia-smi run in the background from `start` to `stop`, which returns what it saw (a
  ClockLog); start again for the next block. Where nvidia-smi is missing or refuses the query,
  the logs stay empty and say why (`note`)."""

  def __init__(self, period_ms: int = 50, smi: str = "nvidia-smi"):
    self._period_ms = period_ms
    self._smi = smi
    path = shutil.which(smi)
    self._cmd = _query(path) if path else None
    self._note = (None if self._cmd else f"{smi} not found" if path is None
                  else f"{smi} refused the clock query")
    self._proc = None
    self._buf = None

  def start(self) -> None:
    if self._proc is not None:
      raise RuntimeError("the sampler is already running")
    if self._cmd is None:
      return
    self._buf = tempfile.TemporaryFile(mode="w+")  # pylint: disable=consider-using-with
    self._proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [*self._cmd, "-lms", str(self._period_ms)], stdout=self._buf,
        stderr=subprocess.DEVNULL)

  def stop(self) -> ClockLog:
    if self._proc is None:
      return ClockLog(note=self._note or "the sampler was not started")
    self._proc.terminate()
    try:
      self._proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    self._buf.seek(0)
    log = ClockLog(samples=parse(self._buf.read()))
    self._buf.close()
    self._proc = self._buf = None
    if not log.samples:
      log.note = f"{self._smi} gave no sample"
    return log


def attach(records: list[dict], sampler: Sampler | None) -> None:
  """Each record gets `clocks`: what `sampler` (running; None attaches nothing) saw since it
  started, per GPU (`ClockLog.summary`) or why there is nothing; the sampler starts again for
  the next block (matmul_rs_bench: one shape's records)."""
  if sampler is None:
    return
  log = sampler.stop()
  sampler.start()
  result = log.result()
  for record in records:
    record["clocks"] = result


@contextlib.contextmanager
def sampled(period_ms: int = 50, smi: str = "nvidia-smi"):
  """Yields a ClockLog, filled when the block ends: every `period_ms` ms of it sampled (or,
  where nvidia-smi cannot, empty with a `note` saying why)."""
  log = ClockLog()
  sampler = Sampler(period_ms, smi)
  sampler.start()
  try:
    yield log
  finally:
    got = sampler.stop()
    log.samples, log.note = got.samples, got.note
