"""Named shapes, one table for tests and experiments.

A `Case` is a global problem: x [m, k], w [k, n] over `num_devices` devices
(per device x [m, k_shard], w [k_shard, n]). Tags select subsets: "seed" (the
16 design shapes at D = 8; the experiments run them at D = the number of visible
GPUs unless told otherwise), "proxy8" (the 16 seed shapes with k = K / 4 at D = 2:
each GPU gets the k_shard = K / 8 it would have at D = 8, a D = 8 proxy on two
GPUs), "ci" (small CPU cases), model tags ("llama70b",
"mixtral8x22b"), projection tags ("o_proj", "down_proj", "w2"), dtype tags
("bf16", "f32"), "awkward" (non-power-of-two n, m = num_devices) and
"min_tile" (m = num_devices * 64: the smallest shapes the fused kernel takes).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Case:
  """One problem shape.

  Attributes:
    name: unique name, e.g. "llama70b_o_proj_m512".
    m: global rows (tokens); the output is scattered along m.
    n: output columns.
    k: global contraction size; each device holds k // num_devices of it.
    num_devices: D, the size of the tensor-parallel axis.
    dtype: input/output dtype name ("bfloat16" or "float32").
    tags: labels for `select`.
  """
  name: str
  m: int
  n: int
  k: int
  num_devices: int
  dtype: str = "bfloat16"
  tags: frozenset[str] = frozenset()

  def __post_init__(self):
    object.__setattr__(self, "tags", frozenset(self.tags))
    for field in ("m", "n", "k", "num_devices"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{self.name}: {field}={value!r} must be a positive int")

  @property
  def k_shard(self) -> int:
    """Per-device contraction size k // num_devices."""
    return self.k // self.num_devices

  @property
  def m_shard(self) -> int:
    """Per-device output rows m // num_devices (scatter_dimension=0)."""
    return self.m // self.num_devices

  @property
  def n_shard(self) -> int:
    """Per-device output columns n // num_devices (scatter_dimension=1)."""
    return self.n // self.num_devices

  def with_num_devices(self, num_devices: int) -> Case:
    """The same global shape on another number of devices (renamed `_d{D}`)."""
    return dataclasses.replace(self, name=f"{self.name}_d{num_devices}",
                               num_devices=num_devices)


# (model, projection, k, n) of the seed problem (docs/design.md section 2).
_PROJECTIONS = (
    ("llama70b", "o_proj", 8192, 8192),
    ("llama70b", "down_proj", 28672, 8192),
    ("mixtral8x22b", "o_proj", 6144, 6144),
    ("mixtral8x22b", "w2", 16384, 6144),
)
_SEED_MS = (512, 2048, 8192, 32768)

SEED_CASES: tuple[Case, ...] = tuple(
    Case(f"{model}_{proj}_m{m}", m=m, n=n, k=k, num_devices=8,
         tags={"seed", model, proj, "bf16"})
    for model, proj, k, n in _PROJECTIONS for m in _SEED_MS)


# The D = 8 per-GPU GEMM (k_shard = K / 8) on two GPUs: k = K / 4 at D = 2.
PROXY8_CASES: tuple[Case, ...] = tuple(
    Case(f"{model}_{proj}_m{m}_proxy8", m=m, n=n, k=k // 4, num_devices=2,
         tags={"proxy8", model, proj, "bf16"})
    for model, proj, k, n in _PROJECTIONS for m in _SEED_MS)


def _ci(name, m, n, k, num_devices, dtype="bfloat16", *tags):
  dtype_tag = {"bfloat16": "bf16", "float32": "f32"}[dtype]
  return Case(f"ci_{name}", m=m, n=n, k=k, num_devices=num_devices,
              dtype=dtype, tags={"ci", dtype_tag, *tags})


# Small CPU cases: the four (n, k) pairs scaled down by 16, awkward sizes,
# D in {2, 4, 8}, bf16 and f32. All divide k by D; n % D == 0 except where
# tagged "n_indivisible" (legal for scatter_dimension=0 only).
CI_CASES: tuple[Case, ...] = (
    _ci("llama70b_o_proj_d8", 64, 512, 512, 8, "bfloat16", "llama70b", "o_proj"),
    _ci("llama70b_down_proj_d8", 64, 512, 1792, 8, "bfloat16", "llama70b",
        "down_proj"),
    _ci("mixtral8x22b_o_proj_d8", 64, 384, 384, 8, "bfloat16", "mixtral8x22b",
        "o_proj"),
    _ci("mixtral8x22b_w2_d8", 64, 384, 1024, 8, "bfloat16", "mixtral8x22b", "w2"),
    _ci("llama70b_o_proj_d2", 32, 512, 512, 2, "bfloat16", "llama70b", "o_proj"),
    _ci("mixtral8x22b_w2_d4", 64, 384, 1024, 4, "bfloat16", "mixtral8x22b", "w2"),
    _ci("n96_d4", 32, 96, 256, 4, "bfloat16", "awkward"),
    _ci("n320_d2", 16, 320, 128, 2, "bfloat16", "awkward"),
    _ci("n100_d8", 16, 100, 192, 8, "bfloat16", "awkward", "n_indivisible"),
    _ci("min_m_d8", 8, 128, 256, 8, "bfloat16", "awkward", "min_m"),
    _ci("min_m_d2", 2, 64, 64, 2, "bfloat16", "awkward", "min_m"),
    # m = num_devices * tile_m (tile_m = 64), n and k_shard one or two tiles:
    # the smallest shapes the fused kernel accepts.
    _ci("min_tile_d8", 512, 128, 512, 8, "bfloat16", "min_tile"),
    _ci("min_tile_d2", 128, 256, 128, 2, "bfloat16", "min_tile"),
    _ci("f32_d8", 64, 256, 512, 8, "float32"),
    _ci("f32_n96_d4", 16, 96, 128, 4, "float32", "awkward"),
    _ci("f32_min_m_d2", 2, 320, 64, 2, "float32", "awkward", "min_m"),
)

# The four (n, k) pairs of the seed projections, for scaled-down checks of each.
SEED_NK_PAIRS: tuple[tuple[int, int], ...] = tuple((n, k) for _, _, k, n in _PROJECTIONS)

ALL_CASES: tuple[Case, ...] = SEED_CASES + PROXY8_CASES + CI_CASES
_BY_NAME = {case.name: case for case in ALL_CASES}
assert len(_BY_NAME) == len(ALL_CASES), "duplicate case names"


def by_name(name: str) -> Case:
  """The case called `name`; KeyError naming the known cases otherwise."""
  try:
    return _BY_NAME[name]
  except KeyError:
    raise KeyError(f"unknown case {name=}; known: {sorted(_BY_NAME)}") from None


def select(tags: str | Iterable[str] | None = None,
           names: Iterable[str] | None = None) -> tuple[Case, ...]:
  """Cases carrying every tag in `tags` and, if given, named in `names`.

  Args:
    tags: a tag or tags that must all be present (None: no filter).
    names: case names to keep, in table order (None: no filter); unknown
      names raise KeyError.

  Returns:
    The matching cases, in table order.
  """
  tags = frozenset([tags] if isinstance(tags, str) else (tags or ()))
  wanted = None
  if names is not None:
    wanted = {by_name(name).name for name in names}
  return tuple(case for case in ALL_CASES
               if tags <= case.tags and (wanted is None or case.name in wanted))


def custom_case(m: int, n: int, k: int, num_devices: int,
                dtype: str = "bfloat16") -> Case:
  """A case outside the table (the experiments' custom m, n, k flags)."""
  return Case(f"custom_m{m}_n{n}_k{k}_d{num_devices}", m=m, n=n, k=k,
              num_devices=num_devices, dtype=dtype, tags={"custom"})
