"""experiments/bit_hashes.py on CPU: case parsing, the comparison of two runs, the digest, and
the flag checks that stop a run before its first case (the kernel itself needs a GPU)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import helpers


@pytest.fixture(name="bit_hashes")
def _bit_hashes():
  """The script as a module, its absl flags removed afterwards (other tests load scripts that
  define flags of the same names)."""
  try:
    yield helpers.load_script("bit_hashes")
  finally:
    helpers.forget_scripts("bit_hashes")


def test_parse_case(bit_hashes):
  assert bit_hashes.parse_case("8:512:8192:1024:t64x128_wn_st") == (
      8, 512, 8192, 1024, "t64x128_wn_st")
  for bad in ("8:512:8192:t64x128", "8:512:8192:1024", "a:512:8192:1024:table"):
    with pytest.raises(ValueError, match="D:m:n:k_shard:variant"):
      bit_hashes.parse_case(bad)


def test_default_cases_parse_and_name_known_variants(bit_hashes):
  import config_variants  # pylint: disable=g-import-not-at-top
  for text in bit_hashes._DEFAULT_CASES:  # pylint: disable=protected-access
    config_variants.check_name(bit_hashes.parse_case(text)[4])


def test_differences_names_changed_and_missing_cases(bit_hashes):
  earlier = [dict(case="a", sha256="1"), dict(case="b", sha256="2")]
  rows = [dict(case="a", sha256="1"), dict(case="b", sha256="3"), dict(case="c", sha256="4")]
  assert bit_hashes.differences(rows, earlier) == ["b", "c"]
  assert bit_hashes.differences(rows[:1], earlier) == []
  # Refused now (no hash) where it ran before, or the other way round: a difference.
  assert bit_hashes.differences([dict(case="a", unavailable="why")], earlier) == ["a"]
  assert bit_hashes.differences(rows[:1], [dict(case="a", unavailable="why")]) == ["a"]
  assert bit_hashes.differences([dict(case="u")], [dict(case="u", unavailable="why")]) == []


def test_inputs_follow_the_shape_not_the_variant_or_position(bit_hashes):
  # Variants of one shape share inputs (their hashes compare within a run), and a case keeps
  # its inputs wherever it stands in --cases (its hash compares across runs).
  seed = bit_hashes.input_seed(8, 512, 6144, 768)
  assert seed == bit_hashes.input_seed(8, 512, 6144, 768)
  assert len({seed, bit_hashes.input_seed(4, 512, 6144, 768),
              bit_hashes.input_seed(8, 512, 6144, 1536)}) == 3
  rows = [dict(case="8:512:6144:768:table", sha256="1"),
          dict(case="8:512:6144:768:t128x96_wn", sha256="1"),
          dict(case="4:512:6144:1536:table", sha256="2"),
          dict(case="4:512:6144:1536:t128x96_wn", sha256="3"),
          dict(case="4:512:6144:1536:ow", unavailable="why"),
          dict(case="2:1024:2048:512:table", sha256="4")]
  assert bit_hashes.distinct_outputs(rows) == {"8:512:6144:768": 1, "4:512:6144:1536": 2}


def test_digest_sees_one_bit_and_the_shape(bit_hashes):
  a = np.arange(12, dtype=np.float32)
  b = a.copy()
  b.view(np.uint32)[5] ^= 1
  assert bit_hashes.digest(a) == bit_hashes.digest(a.copy())
  assert bit_hashes.digest(a) != bit_hashes.digest(b)
  assert bit_hashes.digest(a) != bit_hashes.digest(a.reshape(3, 4))


@pytest.mark.parametrize("cases,message", [
    ("2:512:1024:512:table", "needs a Hopper GPU"),
    ("2:512:1024:table", "D:m:n:k_shard:variant"),
    ("2:512:1024:512:t64", "unknown variant token"),
])
def test_script_stops_before_running(tmp_path, cases, message):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(helpers.REPO))
  proc = subprocess.run(
      [sys.executable, str(helpers.REPO / "experiments" / "bit_hashes.py"), f"--cases={cases}",
       f"--out={tmp_path / 'bits.json'}"], capture_output=True, text=True, timeout=120,
      env=env, cwd=helpers.REPO)
  assert proc.returncode != 0
  assert message in proc.stderr + proc.stdout
  assert not (tmp_path / "bits.json").exists()
