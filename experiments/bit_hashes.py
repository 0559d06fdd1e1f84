"""The fused kernel's output bits in loopback, per case, to compare two trees bit for bit.

  PYTHONPATH=. python experiments/bit_hashes.py --out=/tmp/before.json        # tree A
  PYTHONPATH=. python experiments/bit_hashes.py --compare=/tmp/before.json    # tree B

A change to the kernel that should move no output bit (a refactor of the body, code hoisted out
of a branch) is checked this way on one GPU: the same cases (D virtual ranks, shape, a
config_variants name applied to the kernel's default config), the same seeded inputs, the
sha256 of every output, two calls each (a difference between them is a race). The inputs depend
on the shape alone (`input_seed`), so the variants of one shape in one run compare directly too:
the run lists how many distinct outputs each such shape gave. Each output also
keeps the error rule against the unfused path in the config's order, so a case is correct on
its own too. --compare names every case whose bits differ from the earlier JSON's; the run
exits 1 on a difference, a broken rule or a nondeterministic case.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
import sys
import zlib

from absl import app
from absl import flags

import bench_env  # experiments/ is sys.path[0] when run as a script.
from config_variants import variant_config
import flag_checks

# D:m:n:k_shard:variant. The default list reaches every way a tile leaves a rank: the direct
# push into receive slots, the owner's TMA add (D = 2, and with pulling comm CTAs at D > 2),
# comm CTAs pushing and pulling from staging, the owner pulling ("ow"), pairs along N and
# along M, fp32 partials, the interleaved and the step-major walk.
_DEFAULT_CASES = (
    "2:1024:2048:512:table", "2:1024:2048:512:noadd", "2:1024:2048:512:f32",
    "2:128:1024:512:t64x256_wm", "4:2048:2048:512:table", "4:2048:2048:512:c2",
    "4:2048:2048:512:p2_ring", "4:2048:2048:512:p2_ring_tadd", "4:1024:2048:512:ow",
    "8:512:8192:1024:table", "8:512:8192:1024:t64x128_wn_st", "8:2048:2048:512:ring",
)
_CASES = flags.DEFINE_list("cases", list(_DEFAULT_CASES), "D:m:n:k_shard:variant per case.")
_COMPARE = flags.DEFINE_string("compare", "", "An earlier run's JSON: exit 1 where bits differ.")
_OUT = flags.DEFINE_string("out", "", "JSON output path; default experiments/out/"
                           "bit_hashes.json (git-ignored).")


def parse_case(text: str) -> tuple[int, int, int, int, str]:
  """'D:m:n:k_shard:variant' -> (D, m, n, k_shard, variant); ValueError naming the case."""
  parts = text.split(":")
  if len(parts) != 5 or not all(p.isdigit() for p in parts[:4]):
    raise ValueError(f"case {text!r} is not D:m:n:k_shard:variant")
  d, m, n, k_shard = (int(p) for p in parts[:4])
  return d, m, n, k_shard, parts[4]


def differences(rows: list[dict], earlier: list[dict]) -> list[str]:
  """Cases whose hashes differ from (or are missing in) `earlier`'s rows; a case that ran in
  one and was refused ("unavailable", no hash) in the other differs too."""
  before = {r["case"]: r.get("sha256") for r in earlier}
  return [r["case"] for r in rows if before.get(r["case"]) != r.get("sha256")]


def input_seed(d: int, m: int, n: int, k_shard: int) -> int:
  """The inputs' seed: the shape's, not the case's position or variant (a stable checksum)."""
  return 7000 + zlib.crc32(f"{d}:{m}:{n}:{k_shard}".encode()) % 100_000


def distinct_outputs(rows: list[dict]) -> dict[str, int]:
  """'D:m:n:k_shard' -> how many distinct hashes its variants gave, for shapes run with more
  than one variant (1: every variant gave the same bits on the same inputs)."""
  hashes = {}
  for r in rows:
    if "sha256" in r:
      hashes.setdefault(r["case"].rsplit(":", 1)[0], []).append(r["sha256"])
  return {shape: len(set(h)) for shape, h in hashes.items() if len(h) > 1}


def digest(array) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top
  a = np.asarray(array)
  return hashlib.sha256(a.tobytes() + str((a.shape, a.dtype)).encode()).hexdigest()


def run_case(text: str) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_rs import reference  # pylint: disable=g-import-not-at-top
  from pallas_rs.bench import testing  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import defaults  # pylint: disable=g-import-not-at-top
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top

  d, m, n, k_shard, variant = parse_case(text)
  row = dict(case=text, d=d, m=m, n=n, k_shard=k_shard, variant=variant)
  base = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=d)
  cfg = variant_config(base, variant)
  row["config_repr"] = repr(cfg)
  try:
    fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=jnp.bfloat16, num_devices=d,
                          config=cfg, loopback=True)
  except NotImplementedError as e:
    return row | dict(unavailable=str(e))
  f = jax.jit(functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg))
  xs, ws = testing.stacked_inputs(input_seed(d, m, n, k_shard), d, m, k_shard, n)
  first, second = f(xs, ws), f(xs, ws)
  ref = testing.stacked_reference(xs, ws)
  err = reference.max_rel_error(first, ref)
  unfused = reference.max_rel_error(testing.loopback_unfused(testing.unfused_order(cfg))(
      xs, ws), ref)
  sha256 = digest(first)
  return row | dict(sha256=sha256, deterministic=digest(second) == sha256,
                    max_rel_error=err, unfused_max_rel_error=unfused,
                    rule_holds=bench_env.rule_holds(err, unfused))


def main(argv):
  del argv
  bench_env.configure_environment("single_gpu")
  try:
    variants = [parse_case(text)[4] for text in _CASES.value]
  except ValueError as e:
    raise app.UsageError(f"--cases: {e}") from e
  flag_checks.variant_names("cases", variants)
  bench_env.require_gpu("bit_hashes.py", "runs the kernel in loopback")
  earlier = json.loads(Path(_COMPARE.value).read_text())["rows"] if _COMPARE.value else None
  out = Path(_OUT.value) if _OUT.value else bench_env.default_out("bit_hashes.json")
  record = dict(environment=bench_env.environment_block(sys.argv), rows=[])
  for i, text in enumerate(_CASES.value):
    row = run_case(text)
    record["rows"].append(row)
    bench_env.write_json(out, bench_env.sanitize(record))  # a run cut short keeps its cases
    print(f"[{i + 1}/{len(_CASES.value)}] {text}: {row.get('sha256', 'unavailable')[:12]}",
          flush=True)
  rows = record["rows"]
  ran = [r for r in rows if "sha256" in r]
  bad = [r["case"] for r in ran if not (r["rule_holds"] and r["deterministic"])]
  differ = differences(rows, earlier) if earlier is not None else []
  print(f"\n{'case':34s} {'sha256':12s} {'err / unfused':>14s}  note")
  for r in rows:
    note = r.get("unavailable", "")[:60] or ("DIFFERS" if r["case"] in differ else "")
    ratio = (bench_env.fmt(r["max_rel_error"] / r["unfused_max_rel_error"], ".3f")
             if "sha256" in r and r["unfused_max_rel_error"] else "-")
    print(f"{r['case']:34s} {r.get('sha256', '-')[:12]:12s} {ratio:>14s}  {note}")
  for shape, count in distinct_outputs(rows).items():
    print(f"{shape}: its variants gave {count} distinct output(s) on the same inputs")
  print(f"{len(ran)} of {len(rows)} cases ran; {len(bad)} broke the rule or moved between "
        f"calls; {len(differ) if earlier is not None else '-'} differ from --compare")
  print(f"wrote {out}")
  if bad or differ:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
