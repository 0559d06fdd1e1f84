"""Bit-exact numpy emulations of the two reduce paths, the error rule, and input families.

The correctness rule (docs/design.md section 2): the fused output's max relative error against an
fp32 (here float64) reference must be at most `RULE_BOUND` = 1.1 times that of the unfused path
(`jnp.dot` then a bf16 `psum_scatter`) on the same inputs. The statistic is
`pallas_rs.reference.max_rel_error` (max|out - ref| / max|ref|); `error_ratio` divides two of them.

Both emulations take the per-device **fp32 partial products** `P_s = x_s @ w_s` as inputs
(`partials [D, m, n]`, float32), so they are independent of how a matmul orders its fp32
accumulation: only the rounding of the reduce is emulated, bit for bit.

Unfused path (`unfused_reduce_scatter`), what XLA + NCCL compute for
`psum_scatter(dot(x, w, f32).astype(bf16))`:
  1. every device rounds its fp32 partial to bf16 (round to nearest even);
  2. NCCL's ring reduce-scatter sums the bf16 buffers chunk by chunk. Each hop adds the incoming
     bf16 running sum and the local bf16 partial and stores bf16: one correctly rounded bf16 add
     per hop (`__hadd2` on sm_80+, i.e. `add.rn.bf16x2`; emulated as an fp32 add of two bf16
     values, exact unless their exponents differ by more than 16, then a rounding to bf16 --
     bit-identical to a correctly rounded bf16 add, `bf16_add`). D - 1 roundings of the
     running sum.
  The order of the adds for chunk c (`add_order`):
    "ring":   NCCL's ring algorithm (src/device/reduce_scatter.h, runRing): the rank after c in
              the ring sends its partial, each next rank adds its own and forwards, and c adds its
              own partial last: ring[q+1], ring[q+2], ..., ring[q + D - 1], ring[q] where
              q = ring position of c. `ring` is NCCL's ring (a permutation of the ranks chosen by
              its topology search; identity by default). NCCL may use several rings (channels),
              each for a different slice of the buffer; with full NVLink/NVSwitch connectivity
              they are usually the identity order, but that is not guaranteed.
    "source": sources 0, 1, ..., D - 1 (what pallas_rs.reference.loopback_matmul_reduce_scatter
              does on one GPU).
  At D = 2 every order is the same single add, round(bf16(P_a) + bf16(P_b)) (commutative).
  `accumulate="promoted"` emulates the alternative where XLA would have moved the bf16 convert
  after an fp32 reduce-scatter (no rounding of the partials, fp32 sum, one rounding): the GPU
  baseline run (experiments/numerics.py --what=baseline) tells which one XLA really runs.

Fused path (`fused_owner_sum`), what `epilogue.Epilogue.owner_sum` computes on rank r, in one of
the numerics modes (`NUMERICS_MODES`, config.NUMERICS_MODES: name ->
(Config.partial_dtype, Config.owner_sum)):
  owner_sum="fp32" ("fp32_partials", "bf16_partials"): the peers' partials in NCCL's ring order
  (schedule.ring_slots: sources r+1, r+2, ..., r+D-1), run = p_(r+1), run = fp32(run + p) for
  each next one, where p is the peer's fp32 partial rounded to bf16 (`partial_dtype="bfloat16"`,
  what the peer stores) or kept in fp32 (`"float32"`); then the own fp32 partial P_r (never
  rounded) is added last, fp32(run + P_r), and the sum rounded once to bf16. With fp32 partials
  that is `unfused_reduce_scatter(order="ring", accumulate="promoted")` term for term.
  owner_sum="bf16_ring" ("unfused_order", bf16 partials only): the unfused path's arithmetic.
  The slots are read in schedule.ring_slots order (sources r+1, r+2, ..., r+D-1); the running
  sum starts as the bf16 partial of r+1, each next peer is one bf16 add
  run = round_bf16(fp32(run) + fp32(p)), and the owner's own partial, rounded to bf16 like
  every other partial, is added last: out = round_bf16(run + round_bf16(P_r)). That is
  `unfused_reduce_scatter(order="ring")` on the identity ring, term for term, so the output is
  bit-identical to the unfused emulation (tests/test_numerics.py), and to the real unfused
  path wherever the kernel's fp32 partials equal cuBLAS's and NCCL sums on the identity ring.
  Not a bound by itself: where a partial differs from cuBLAS's in its last fp32 bit and that
  flips its bf16 rounding, the output moves by a bf16 ulp (measured by experiments/numerics.py).

The bf16 add: the sum of two bf16 values is exact in fp32 whenever their exponents differ by at
most 16 (two 8-bit significands 16 binades apart span 24 bits; a carry out of the top needs a
gap <= 7) and it does not overflow fp32 (both operands near 2^128); from a gap of 17 on fl32 may
round. round_bf16(fl32(a + b)) is nevertheless the correctly rounded bf16 sum for every pair of
bf16 values, infinities included (fp32's 24 bits >= 2 * 8 + 2, so the double rounding is
innocuous: where fl32 rounds, the smaller operand is below 2^-16 of the larger one and the sum
cannot come near a bf16 midpoint). tests/test_numerics.py checks both claims exhaustively over a
structured set of 1.3e8 pairs (all 2^32 pairs with PALLAS_RS_ALL_BF16_PAIRS=1).

Why `partial_dtype="float32"` keeps the promise by construction: with s' the owner's fp32 sum,
round_bf16(s') is the bf16 value nearest to s', so for any bf16 output u (the unfused one
included) |fused - s'| <= |u - s'| elementwise. Against a reference r: |fused - r| <=
|u - r| + 2|r - s'|, hence max_rel_error(fused) <= max_rel_error(unfused) + 2 max|r - s'| / max|r|,
where |r - s'| is only fp32-level error (the fp32 sum of the D partials and the partials' own fp32
accumulation, ~1e-6 relative), against a bf16-level max error of ~2e-3: the ratio stays below
1 + 1e-3, far inside 1.1. With bf16 partials there is no such bound: the fused error is one rounding
of each peer partial plus the final rounding, the unfused one D roundings of partials and D - 1 of
the running sum, so the fused path is usually more accurate, but the max over elements of two
different rounding patterns can come out larger for the fused one (a ratio above 1.1 at D = 2 is
rare but real, see tests/test_numerics.py).

Input families (`family_inputs`, jax, traceable: used on device by experiments/numerics.py and on
CPU by the tests): global x [m, k] (k = k_shard * D, channels along k) and w [k, n], split along k
over the ranks by `split_inputs`, so each rank holds different data.
"""
from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from pallas_rs import reference
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import schedule
# Re-exported: the input families (defined beside the project's other input generators) and the
# per-rank view of `family_inputs`.
from pallas_rs.bench.testing import (CHANNEL_LOG_SIGMA, FAMILIES, NUM_OUTLIER_CHANNELS,  # pylint: disable=unused-import
                               OUTLIER_SCALE, WEIGHT_STD, family_inputs, family_scales,
                               split_inputs)

RULE_BOUND = 1.1
# The kernel's numerics modes, one definition (pallas_rs/kernel/config.py).
PARTIAL_DTYPES = config_lib.PARTIAL_DTYPES
OWNER_SUMS = config_lib.OWNER_SUMS
NUMERICS_MODES = config_lib.NUMERICS_MODES
MODE_NAMES = tuple(NUMERICS_MODES)
# The modes whose rule holds by construction (module doc: a bound of 1 + ~1e-3); the others are
# allowed at a D only where the measured max ratio over >= MIN_RULE_INPUTS inputs of each of
# the FAMILIES is <= RULE_BOUND (`rule_verdict`).
GUARANTEED_MODES = ("fp32_partials",)
MIN_RULE_INPUTS = 1000
UNFUSED_ORDERS = ("ring", "source")
UNFUSED_ACCUMULATE = ("bfloat16", "promoted")
BF16 = np.dtype(ml_dtypes.bfloat16)


__all__ = [
    "BF16", "FAMILIES", "GUARANTEED_MODES", "MIN_RULE_INPUTS", "MODE_NAMES", "NUMERICS_MODES",
    "OWNER_SUMS", "PARTIAL_DTYPES", "RULE_BOUND", "UNFUSED_ACCUMULATE", "UNFUSED_ORDERS",
    "add_order", "bf16_add", "case_errors", "error_ratio", "family_inputs", "family_scales",
    "fused_owner_sum", "max_rel_error", "mode_of", "mode_summaries", "partials_and_reference",
    "ratio_summary", "resolve_mode", "round_bf16", "rule_verdict", "split_inputs",
    "unfused_reduce_scatter",
]

max_rel_error = reference.max_rel_error  # The rule's statistic; the only one used here.


def round_bf16(a) -> np.ndarray:
  """float32 array of `a` rounded to bf16 (nearest even), via float32 (never double rounding
  from float64: inputs must be float32 or bf16)."""
  a = np.asarray(a)
  if a.dtype == BF16:
    return a.astype(np.float32)
  if a.dtype != np.float32:
    raise TypeError(f"round_bf16 takes float32 or bfloat16, got {a.dtype} (a float64 -> bf16 "
                    "cast would not be the fp32 -> bf16 rounding the GPU does)")
  return a.astype(BF16).astype(np.float32)


def bf16_add(a, b) -> np.ndarray:
  """The bf16 add as the GPU does it (`add.rn.bf16`), on bf16 values held in float32:
  round_bf16(fl32(a + b)), the correctly rounded bf16 sum (module doc; tested exhaustively)."""
  a, b = np.asarray(a), np.asarray(b)
  for v in (a, b):
    if v.dtype not in (np.float32, BF16):
      raise TypeError(f"bf16_add takes float32 or bfloat16, got {v.dtype}")
  with np.errstate(over="ignore", invalid="ignore"):  # inf and inf - inf as the GPU gives
    return round_bf16(a.astype(np.float32) + b.astype(np.float32))


def resolve_mode(mode: str | None = None, *, partial_dtype: str | None = None,
                 owner_sum: str | None = None) -> tuple[str, str]:
  """(partial_dtype, owner_sum) of a numerics mode, or of the two fields given directly
  (defaults "bfloat16" and "fp32", the Config defaults); both at once is an error."""
  if mode is not None:
    if partial_dtype is not None or owner_sum is not None:
      raise ValueError(f"give mode={mode!r} or partial_dtype / owner_sum, not both")
    if mode not in NUMERICS_MODES:
      raise ValueError(f"numerics mode {mode!r} must be one of {MODE_NAMES}")
    return NUMERICS_MODES[mode]
  partial_dtype = "bfloat16" if partial_dtype is None else partial_dtype
  owner_sum = "fp32" if owner_sum is None else owner_sum
  if partial_dtype not in PARTIAL_DTYPES:
    raise ValueError(f"partial_dtype={partial_dtype!r} must be one of {PARTIAL_DTYPES}")
  if owner_sum not in OWNER_SUMS:
    raise ValueError(f"owner_sum={owner_sum!r} must be one of {OWNER_SUMS}")
  if owner_sum == "bf16_ring" and partial_dtype != "bfloat16":
    raise ValueError(f"owner_sum='bf16_ring' adds bf16 partials; {partial_dtype=} must be "
                     "'bfloat16'")
  return partial_dtype, owner_sum


def mode_of(partial_dtype: str, owner_sum: str = "fp32") -> str:
  """The numerics mode name of (partial_dtype, owner_sum) (as Config.numerics)."""
  pair = resolve_mode(partial_dtype=partial_dtype, owner_sum=owner_sum)
  return next(k for k, v in NUMERICS_MODES.items() if v == pair)


def _check_partials(partials) -> np.ndarray:
  p = np.asarray(partials)
  if p.ndim != 3:
    raise ValueError(f"partials must be [D, m, n], got {p.shape}")
  if p.dtype not in (np.float32, BF16):
    raise TypeError(f"partials must be float32 (or bfloat16), got {p.dtype}")
  d, m, _ = p.shape
  if m % d:
    raise ValueError(f"m={m} not divisible by D={d}")
  return p


def add_order(chunk: int, num_devices: int, order: str | Sequence[int] = "ring",
              ring: Sequence[int] | None = None) -> list[int]:
  """Sources in the order the unfused reduce-scatter adds them for `chunk` (see module doc).

  `order` is "ring", "source", or an explicit permutation of the D sources (used as is).
  The first source is the initial running sum; each following one is one rounded add.
  """
  d = num_devices
  if not isinstance(order, str):
    srcs = [int(s) for s in order]
    if sorted(srcs) != list(range(d)):
      raise ValueError(f"explicit order {srcs} is not a permutation of range({d})")
    return srcs
  if order == "source":
    return list(range(d))
  if order == "ring":
    ring = list(range(d)) if ring is None else [int(r) for r in ring]
    if sorted(ring) != list(range(d)):
      raise ValueError(f"ring {ring} is not a permutation of range({d})")
    q = ring.index(chunk)
    return [ring[(q + i) % d] for i in range(1, d + 1)]
  raise ValueError(f"order={order!r} must be one of {UNFUSED_ORDERS} or a permutation")


def unfused_reduce_scatter(partials, *, order: str | Sequence[int] = "ring",
                           ring: Sequence[int] | None = None,
                           accumulate: str = "bfloat16") -> np.ndarray:
  """The unfused path from fp32 partials [D, m, n] -> bf16 [D, m // D, n] (out[c] on rank c).

  accumulate="bfloat16": partials rounded to bf16, then D - 1 adds in `add_order`, each rounded
  to bf16 (NCCL on bf16 buffers). "promoted": no rounding of the partials, fp32 adds in the same
  order, one rounding at the end (what an fp32 reduce-scatter followed by the convert gives).
  """
  p = _check_partials(partials)
  d, m, n = p.shape
  chunk = m // d
  if accumulate == "bfloat16":
    p = round_bf16(p)
  elif accumulate == "promoted":
    p = p.astype(np.float32)
  else:
    raise ValueError(f"accumulate={accumulate!r} must be one of {UNFUSED_ACCUMULATE}")
  blocks = p.reshape(d, d, chunk, n)  # [src, dst chunk, rows, n]
  out = np.empty((d, chunk, n), BF16)
  for c in range(d):
    srcs = add_order(c, d, order, ring)
    acc = blocks[srcs[0], c]
    for s in srcs[1:]:
      with np.errstate(over="ignore", invalid="ignore"):  # inf, inf - inf: as the GPU gives
        acc = acc + blocks[s, c]  # float32 + float32 -> float32 (round to nearest)
      if accumulate == "bfloat16":
        acc = round_bf16(acc)
    out[c] = acc.astype(BF16)
  return out


def fused_owner_sum(partials, *, partial_dtype: str | None = None,
                    owner_sum: str | None = None, mode: str | None = None) -> np.ndarray:
  """The fused kernel's result from fp32 partials [D, m, n] -> bf16 [D, m // D, n].

  The arithmetic is chosen by `mode` (a key of NUMERICS_MODES) or by `partial_dtype` and
  `owner_sum` (Config's fields; default "bfloat16" / "fp32", i.e. "bf16_partials"):
  owner_sum="fp32": the slots in schedule.ring_slots order summed in fp32, each partial rounded
  to bf16 first when partial_dtype="bfloat16" (what the peer sends) or as is for "float32", then
  rank r's own fp32 partial P_r[chunk r] added last; rounds once.
  owner_sum="bf16_ring": the slots in schedule.ring_slots order, a bf16 add per peer after the
  first, the own partial rounded to bf16 and added last (module doc), as the kernel's
  `Epilogue.owner_sum` does it (or its comm CTAs' TMA adds: docs/design.md section 3.5).
  """
  partial_dtype, owner_sum = resolve_mode(mode, partial_dtype=partial_dtype,
                                          owner_sum=owner_sum)
  p = _check_partials(partials).astype(np.float32)
  d, m, n = p.shape
  chunk = m // d
  blocks = p.reshape(d, d, chunk, n)
  sent = round_bf16(blocks) if partial_dtype == "bfloat16" else blocks
  out = np.empty((d, chunk, n), BF16)
  for r in range(d):
    if owner_sum == "bf16_ring":
      run = None  # The running bf16 sum (held in float32), as the kernel holds it.
      for j in schedule.ring_slots(d):
        part = sent[schedule.source_of_slot(r, j, d), r]
        run = part if run is None else bf16_add(run, part)
      own = round_bf16(blocks[r, r])
      out[r] = (own if run is None else bf16_add(run, own)).astype(BF16)
      continue
    run = None  # The peers' running fp32 sum, as the kernel (or its sum slot) holds it.
    with np.errstate(over="ignore", invalid="ignore"):
      for j in schedule.ring_slots(d):
        part = sent[schedule.source_of_slot(r, j, d), r]
        run = part if run is None else run + part
      acc = blocks[r, r] if run is None else run + blocks[r, r]
    out[r] = acc.astype(BF16)
  return out


def error_ratio(err_fused: float, err_unfused: float) -> float:
  """err_fused / err_unfused (the rule asks <= RULE_BOUND); 1.0 if both are 0, inf if only the
  unfused error is 0."""
  if err_unfused == 0.0:
    return 1.0 if err_fused == 0.0 else float("inf")
  return float(err_fused) / float(err_unfused)


def case_errors(partials, ref, *, modes: Sequence[str] = MODE_NAMES,
                partial_dtypes: Sequence[str] = (), orders: Sequence[str] = UNFUSED_ORDERS,
                ring=None) -> dict[str, float]:
  """max_rel_error of each emulated path against `ref` [D, m // D, n] (float64).

  Keys: "unfused_<order>" for each order, "fused_<mode>" for each numerics mode, and
  "fused_<partial_dtype>" (owner_sum="fp32") for each of `partial_dtypes` (the older naming).
  """
  errs = {f"unfused_{o}": max_rel_error(unfused_reduce_scatter(partials, order=o, ring=ring),
                                        ref) for o in orders}
  errs.update({f"fused_{md}": max_rel_error(fused_owner_sum(partials, mode=md), ref)
               for md in modes})
  errs.update({f"fused_{pd}": max_rel_error(fused_owner_sum(partials, partial_dtype=pd), ref)
               for pd in partial_dtypes})
  return errs


def partials_and_reference(xs, ws, *, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """CPU: fp32 partials [D, m, n] (BLAS sgemm per rank) and a float64 reference [D, m // D, n].

  exact=False: the reference is the float64 sum of those fp32 partials (testing.stacked_reference's
  definition; both emulated paths then start from the same partials, so the ratio measures the
  reduce alone). exact=True: float64 products (reference.numpy_reference's definition), 2-3x
  slower; the two differ by the partials' fp32 accumulation error (~1e-6 relative).
  """
  x32 = np.asarray(xs).astype(np.float32)
  w32 = np.asarray(ws).astype(np.float32)
  d, m, _ = x32.shape
  partials = np.matmul(x32, w32)
  if exact:
    full = sum(np.matmul(x32[r].astype(np.float64), w32[r].astype(np.float64))
               for r in range(d))
  else:
    full = partials.astype(np.float64).sum(axis=0)
  return partials, full.reshape(d, m // d, -1)


def ratio_summary(err_fused, err_unfused, seeds=None, *, bound: float = RULE_BOUND) -> dict:
  """Distribution of the per-input ratio err_fused / err_unfused (error_ratio, elementwise).

  Returns max, p99, median, min, num_over_bound (ratio > bound), the worst input's seed (its
  index when `seeds` is None) and both errors at that input. A NaN ratio (a NaN error) does not
  keep the rule: it counts as inf (num_nan_ratio says how many), so max and rule_verdict see it.
  """
  ef = np.asarray(err_fused, np.float64).ravel()
  eu = np.asarray(err_unfused, np.float64).ravel()
  if ef.shape != eu.shape or not ef.size:
    raise ValueError(f"need equal, non-empty error arrays, got {ef.shape} and {eu.shape}")
  seeds = np.arange(ef.size) if seeds is None else np.asarray(seeds).ravel()
  ratio = np.array([error_ratio(f, u) for f, u in zip(ef, eu)])
  nan = np.isnan(ratio)
  ratio = np.where(nan, np.inf, ratio)
  worst = int(np.argmax(ratio))
  with np.errstate(invalid="ignore"):  # inf - inf inside the interpolation: the limit is inf
    p99, median = np.nan_to_num(np.percentile(ratio, [99, 50]), nan=np.inf)
  return dict(num_inputs=int(ef.size), max=float(ratio[worst]),
              p99=float(p99), median=float(median),
              min=float(ratio.min()), num_over_bound=int(np.sum(ratio > bound)),
              bound=bound, worst_seed=int(seeds[worst]), err_fused_at_worst=float(ef[worst]),
              err_unfused_at_worst=float(eu[worst]), num_nan_ratio=int(nan.sum()))


def mode_summaries(errors, seeds=None, *, modes: Sequence[str] = MODE_NAMES,
                   unfused: str = "unfused_ring", bound: float = RULE_BOUND) -> dict:
  """{mode: ratio_summary(errors["fused_<mode>"], errors[unfused], seeds)}.

  `errors`: a dict of per-input error arrays with case_errors' keys, or a list of case_errors
  dicts (one per input).
  """
  if not isinstance(errors, dict):
    errors = {k: [e[k] for e in errors] for k in errors[0]}
  return {md: ratio_summary(errors[f"fused_{md}"], errors[unfused], seeds, bound=bound)
          for md in modes}


def rule_verdict(summaries: Sequence[dict], *, families: Sequence[str] = FAMILIES,
                 min_inputs: int = MIN_RULE_INPUTS, bound: float = RULE_BOUND) -> dict:
  """Whether one mode at one D keeps the rule, from its ratio summaries (one per family, each
  with "family", "num_inputs" and "max"; rows with an "error" count as missing).

  holds: False if any family's max > bound (a failure needs no more inputs); True if every
  family of `families` has >= min_inputs inputs and max <= bound; None (not established)
  otherwise. The gate allows a measured mode at a D only where holds is True.
  """
  ok = [s for s in summaries if "error" not in s and s.get("num_inputs")]
  by_fam = {}
  for s in ok:
    by_fam.setdefault(s["family"], []).append(s)
  worst = max(ok, key=lambda s: s["max"], default=None)
  over = sum(s.get("num_over_bound", 0) for s in ok)
  missing = sorted(f for f in families
                   if sum(s["num_inputs"] for s in by_fam.get(f, [])) < min_inputs)
  if worst is not None and worst["max"] > bound:
    holds, why = False, f"max {worst['max']:.4f} > {bound} ({worst['family']})"
  elif missing:
    holds, why = None, f"fewer than {min_inputs} inputs (or none) for {missing}"
  else:
    holds, why = True, f"max {worst['max']:.4f} <= {bound} over {len(families)} families"
  return dict(holds=holds, reason=why, max=None if worst is None else worst["max"],
              worst_family=None if worst is None else worst["family"],
              worst_seed=None if worst is None else worst.get("worst_seed"),
              num_over_bound=over, num_inputs=sum(s["num_inputs"] for s in ok),
              families=sorted(by_fam), min_inputs=min_inputs, bound=bound)
