"""Up-front checks of the experiment scripts' list flags, and the timing flags they share.

A script's `check_flags()` calls these first thing in its main (after
`bench_env.configure_environment`, since they may import jax), so that a misspelt shape,
config variant or mode stops a run before its first case rather than minutes into it: the
calls of experiments/run_multi_gpu.sh are device time, and tests/test_run_multi_gpu.py puts
each of them through its script's flag parsing and `check_flags()` on a CPU machine.
Each raises `absl.app.UsageError` naming the flag and the bad values.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
import sys
from typing import Any

from absl import app
from absl import flags


def _refuse(flag: str, bad: Sequence[str], what: str) -> None:
  if bad:
    raise app.UsageError(f"--{flag}: {what}: {', '.join(map(repr, bad))}")


def shape_names(flag: str, names: Iterable[str] | None) -> None:
  """Every name is a case of pallas_rs.bench.shapes (seed, proxy8 or CI)."""
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  bad = []
  for name in names or ():
    try:
      shapes.by_name(name)
    except KeyError:
      bad.append(name)
  _refuse(flag, bad, "not a shape of pallas_rs/bench/shapes.py (e.g. llama70b_o_proj_m512, "
          "mixtral8x22b_w2_m2048_proxy8)")


def shape_tags(flag: str, tags: Iterable[str] | None) -> None:
  """Every tag is carried by some case of pallas_rs.bench.shapes."""
  from pallas_rs.bench import shapes  # pylint: disable=g-import-not-at-top
  known = set().union(*(case.tags for case in shapes.ALL_CASES))
  _refuse(flag, [t for t in tags or () if t and t not in known],
          f"not a shape tag (known: {sorted(known)})")


def variant_names(flag: str, names: Iterable[str] | None) -> None:
  """Every name is made of config_variants tokens."""
  import config_variants  # pylint: disable=g-import-not-at-top
  bad = []
  for name in names or ():
    try:
      config_variants.check_name(name)
    except ValueError as e:
      bad.append(str(e))
  if bad:
    raise app.UsageError(f"--{flag}: {'; '.join(bad)} (experiments/config_variants.py)")


def subset(flag: str, values: Iterable[str] | None, allowed: Iterable[str]) -> None:
  """Every value is one of `allowed`."""
  allowed = sorted(allowed) if isinstance(allowed, (set, frozenset)) else list(allowed)
  _refuse(flag, [v for v in values or () if v not in allowed], f"not one of {allowed}")


def positive_ints(flag: str, values: Iterable[str] | None) -> None:
  """Every value is a positive integer."""
  _refuse(flag, [v for v in values or () if not (str(v).isdigit() and int(v) > 0)],
          "not a positive integer")


def non_negative_ints(flag: str, values: Iterable[str] | None) -> None:
  """Every value is an integer >= 0 (a count where 0 means none or a default)."""
  _refuse(flag, [v for v in values or () if not str(v).isdigit()], "not an integer >= 0")


def _flag_module(module_name: str) -> str:
  """The name absl files a flag of `module_name` under (the script's path for __main__, so
  that --help lists it with the script's own flags)."""
  return sys.argv[0] if module_name == "__main__" else module_name


def define_interleave(module_name: str):
  """--interleave of a script that times functions in turn (pallas_rs.bench.alternating),
  registered as `module_name`'s flag (tests/helpers.forget_scripts removes it with the
  script); returns its holder."""
  return flags.DEFINE_bool(
      "interleave", True, "With CUPTI: within a round, the functions run call by call in "
      "turn in one CUPTI session (pallas_rs.bench.alternating); --nointerleave: each "
      "function's calls back to back.", module_name=_flag_module(module_name))


class TimingFlags:
  """--rounds and --interleave of a script whose main times `timed` in turn with
  `alternating.time_alternating`, registered as `module_name`'s flags."""

  def __init__(self, module_name: str, timed: str):
    self._rounds = flags.DEFINE_integer(
        "rounds", 10, f"Timing rounds: --iterations split over them, {timed} timed in turn "
        "within each.", module_name=_flag_module(module_name))
    self._interleave = define_interleave(module_name)

  def check(self) -> None:
    positive_ints("rounds", [self._rounds.value])

  def kwargs(self, iterations: int) -> dict[str, Any]:
    """`time_alternating`'s rounds (at most `iterations`) and interleave."""
    return {"rounds": min(self._rounds.value, iterations),
            "interleave": self._interleave.value}

