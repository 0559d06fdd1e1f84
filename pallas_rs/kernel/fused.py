"""Entry points of the fused Mosaic GPU kernel (matmul + reduce-scatter along M).

`fused_matmul_reduce_scatter` runs inside shard_map on real devices (NVLink transport);
`loopback_matmul_reduce_scatter` runs the same protocol with D virtual ranks on one GPU;
`local_matmul` is the kernel at D = 1 (no communication); `rank_alone` times one rank's share
of a D-device call on one GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_rs import platform
from pallas_rs.kernel import body as body_lib
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import defaults
from pallas_rs.kernel import rank as rank_lib
from pallas_rs.kernel import schedule
from pallas_rs.kernel import transport as transport_lib

Config = config_lib.Config
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16),)
MAX_DEVICES = 8


# Mosaic GPU lowers a TMA load from a peer's buffer in Warpgroup semantics from this jax on
# (checked: 0.11.2 lowers and runs it on two H200s; 0.10.2 raises "GMEM refs with peer ids
# are not supported in warpgroup lowering").
REMOTE_TMA_LOAD_JAX = (0, 11, 2)


def nvlink_unverified(config: Config, num_devices: int) -> str | None:
  """Why `config` is refused over NVLink although loopback runs it correctly, or None.

  Without the owner's TMA add, the 128 x 256 CTA tile with its warpgroups split along M (two
  64 x 256 wgmma tiles) stalled in its first call in 3 of 3 tries on two H200s (BUILD_NOTES,
  2026-12-01 fifth session). Loopback runs it correctly at
  D = 2, 4 and 8, and its compiled code is that of the N split of the same CTA tile (which runs
  over NVLink) but for the wgmma shape and a row offset (sixth session): the cause is open
  between the split and the 256-column wgmma. So without the add NVLink runs what it has run:
  the N split with warpgroup tiles of at most 128 columns (with the add, both the M split's 128
  x 256 and 128 x 192 ran). All three stalls came in one pytest test after its sibling in the
  same process, which hung again on 2026-12-04 with an N-split reference, while this family
  alone ran 212 calls without one: lift this once `run_multi_gpu.sh hang` clears the config."""
  if config.pingpong and num_devices > 1:
    return ("pingpong (the warpgroup tiles in turn through one SMEM ring) has not run over "
            "NVLink yet: it is checked in CPU interpret mode and measured on one GPU only "
            "(BUILD_NOTES 2026-12-07); experiments pass unverified=True")
  if not config_lib.nvlink_has_run(config.tile_n, config.wg_dimension, config.sum_in_output,
                                    num_devices):
    return (f"warpgroup tiles of {config.tile_m} x {config.tile_n} side by side along "
            f"{config.wg_dimension.name} without the TMA add have not run over NVLink (the M "
            "split of 128 x 256 stalled 3 of 3 tries on two H200s, cause open: BUILD_NOTES "
            "2026-12-01); use wg_dimension=N with tile_n <= 128, or tma_add=True at "
            "num_devices = 2 in the ring's numerics")
  return None


def remote_tma_loads_supported() -> bool:
  return tuple(jax.__version_info__[:3]) >= REMOTE_TMA_LOAD_JAX


def check_supported(*, m: int, k_shard: int, n: int, dtype, num_devices: int,
                    config: Config | None = None, loopback: bool = False,
                    unverified: bool = False, alone: bool = False) -> Config:
  """Returns the config to use, or raises NotImplementedError saying why the kernel can't.
  `loopback`: for the one-GPU transport (no remote loads, and `nvlink_unverified` does not
  apply); `alone`: one rank without peers (`rank_alone`: neither applies either).
  `unverified`: let an NVLink config that `nvlink_unverified` refuses through (the
  experiments that investigate it; never the public API)."""
  peers = not (loopback or alone)  # over NVLink
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(f"fused kernel supports bfloat16 only, got dtype={jnp.dtype(dtype)}")
  if not 1 <= num_devices <= MAX_DEVICES:
    raise NotImplementedError(
        f"fused kernel supports 1 to {MAX_DEVICES} devices (one node), got {num_devices=}")
  if m % num_devices:
    raise ValueError(f"{m=} must be divisible by {num_devices=}")
  sms = gpu_num_sms()
  if config is None:
    config = defaults.default_config(m=m, n=n, k_shard=k_shard, num_devices=num_devices,
                                     num_sms=sms or config_lib.DEFAULT_NUM_SMS)
  if sms is not None and config.num_sms > sms:
    # Every CTA must be resident: an owner's CTA waits on other ranks' CTAs, and a grid larger
    # than the GPU could leave the CTAs that would signal it unscheduled (deadlock).
    raise NotImplementedError(
        f"config.num_sms={config.num_sms} exceeds the {sms} SMs of {jax.devices()[0].device_kind}")
  config.check_shape(m=m, n=n, k_shard=k_shard, num_devices=num_devices, loopback=loopback)
  if peers and num_devices > 1 and config.reads_peers and not remote_tma_loads_supported():
    raise NotImplementedError(
        f"comm_mode={config.comm_mode!r} TMA-loads from peers, which Mosaic GPU lowers "
        f"from jax {'.'.join(map(str, REMOTE_TMA_LOAD_JAX))} on (this is {jax.__version__}); "
        "use comm_mode='push'")
  if peers and not unverified and (why := nvlink_unverified(config, num_devices)):
    raise NotImplementedError(why)
  return config


@dataclasses.dataclass(frozen=True)
class CheckedConfig:
  """A config that `check_supported` (and, inside shard_map, `check_mesh`) accepted for one
  problem. `pallas_rs.tuning.gate.decide` hands this down, once per call; the entry points below
  then use the config without checking again (a plain Config or None is checked as usual)."""
  config: Config
  problem: tuple  # (m, k_shard, n, dtype name, num_devices)

  @classmethod
  def of(cls, config: Config, *, m, k_shard, n, dtype, num_devices) -> CheckedConfig:
    return cls(config, (m, k_shard, n, jnp.dtype(dtype).name, num_devices))


def _checked(config, *, m, k_shard, n, dtype, num_devices, loopback=False,
             unverified=False, alone=False) -> Config:
  """The config to run: a CheckedConfig's for this very problem, else `check_supported`'s."""
  if isinstance(config, CheckedConfig):
    problem = (m, k_shard, n, jnp.dtype(dtype).name, num_devices)
    if config.problem != problem:
      raise ValueError(f"config was checked for {config.problem}, not {problem}")
    return config.config
  return check_supported(m=m, k_shard=k_shard, n=n, dtype=dtype, num_devices=num_devices,
                         config=config, loopback=loopback, unverified=unverified, alone=alone)


def gpu_num_sms() -> int | None:
  """SM count of the local GPU, or None without one (lowering from a CPU machine uses the
  config's num_sms, DEFAULT_NUM_SMS by default)."""
  dev = jax.devices()[0]
  return getattr(dev, "core_count", None) if dev.platform == "gpu" else None


def check_mesh(axis_name) -> str:
  """Inside shard_map: the mesh axis the kernel reduces over, or NotImplementedError saying why
  the fused kernel cannot run on this mesh.

  Supported (docs/design.md section 4): one process; every mesh axis manual in the enclosing
  shard_map (Mosaic GPU fills the coordinates of the axes the kernel does not reduce over with
  the caller's own, so peers stay in the caller's group: `NVLinkTransport._device_id`);
  `axis_name` one axis name, or a tuple of names of which at most one has size > 1; at most
  MAX_DEVICES devices in the mesh; device ids in row-major order (checked here where the
  concrete mesh is visible at trace time, else by Mosaic GPU when the kernel is lowered).
  """
  if jax.process_count() > 1:
    raise NotImplementedError(
        f"{platform.MULTI_PROCESS_REASON}; process_count={jax.process_count()}")
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(mesh.shape)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  # (An axis name the mesh lacks counts as size 1: the API has validated it already.)
  reduced = {name: sizes[name] for name in names if sizes.get(name, 1) > 1}
  if len(reduced) > 1:
    raise NotImplementedError(
        f"fused kernel reduces over one mesh axis; {axis_name=} spans {len(reduced)} axes of "
        f"size > 1 ({reduced}) of the mesh {sizes}; use one axis of that size, or "
        f"implementation='xla'")
  # A non-manual axis has no axis_index inside the kernel, so the device id of a peer (mesh
  # coordinates on every axis) cannot be formed.
  auto = [name for name in sizes if name not in mesh.manual_axes]
  if auto:
    raise NotImplementedError(
        f"fused kernel needs every mesh axis manual in the enclosing shard_map; {auto} of the "
        f"mesh {sizes} are not (call it in a shard_map over all mesh axes)")
  if mesh.size > MAX_DEVICES:
    # XLA's collective metadata holds the peers of at most 8 local devices.
    raise NotImplementedError(
        f"fused kernel runs on meshes of at most {MAX_DEVICES} devices (one node), got the "
        f"mesh {sizes} ({mesh.size} devices)")
  concrete = platform.traced_mesh(mesh)
  if concrete is not None and not np.array_equal(concrete.device_ids.ravel(),
                                                 np.arange(concrete.size)):
    raise NotImplementedError(
        f"fused kernel needs the mesh's device ids in row-major order (Mosaic GPU: "
        f"mesh.device_ids.ravel() == arange({concrete.size})); the mesh {sizes} has device ids "
        f"{concrete.device_ids.ravel().tolist()}")
  return _reduced_axis(axis_name)


def _reduced_axis(axis_name) -> str:
  """The mesh axis the kernel reduces over (`check_mesh` checks the mesh first)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  sizes = dict(jax.sharding.get_abstract_mesh().shape)
  return next((name for name in names if sizes.get(name, 1) > 1), names[0])


_PROFILE: dict = {}  # Set only inside `profile`.


@contextlib.contextmanager
def profile(directory: str, space: int = 128):
  """Kernels traced inside this context record a timeline of their named phases (body.py: per
  tile; comm.py: per step) with Mosaic GPU's profiler: a Perfetto trace under `directory` (named
  when the kernel lowers, never overwritten: a later call's trace is dumped only once the
  earlier one is moved away, as experiments/timeline.py does), up to `space` events per
  warpgroup (at most 8 a tile: more is undefined behaviour), in `profile_smem_bytes(space)` of
  each CTA's shared memory, which the config must leave free (experiments/timeline.py sizes
  both). Diagnostics only: each event reads the clock, and a function traced outside the context
  (a cached jit) does not profile."""
  if space < 1:
    raise ValueError(f"{space=} must be >= 1")
  previous = dict(_PROFILE)
  _PROFILE.update(profile_dir=str(directory), profile_space=int(space))
  try:
    yield
  finally:
    _PROFILE.clear()
    _PROFILE.update(previous)


def profile_smem_bytes(space: int) -> int:
  """Shared memory the profiler takes per CTA: 4 u32 entries per event, per warpgroup."""
  return (schedule.NUM_COMPUTE_WGS + 1) * space * 4 * 4


def _compiler_params():
  # Lane semantics is the default in jax 0.10.x, Warpgroup in 0.11.x: always say which.
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **_PROFILE)


def _skip(ablate) -> frozenset[str]:
  skip = frozenset(ablate)
  if not skip <= rank_lib.ABLATIONS:
    raise ValueError(f"ablate={sorted(skip)} must be a subset of {sorted(rank_lib.ABLATIONS)}")
  return skip


def _build(transport, *, out_type, config: Config, num_devices: int, name: str,
           skip: frozenset[str] = frozenset()):
  grid, grid_names = transport.grid(config.num_sms)
  body = functools.partial(body_lib.kernel_body, config=config, num_devices=num_devices,
                           transport=transport, skip=skip)
  if not config.receive_slots(num_devices):
    body = functools.partial(_no_recv, body)  # (out, then the staging buffer if any)
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=grid,
      grid_names=grid_names,
      cluster=(1,),
      cluster_names=("cluster",),
      num_threads=schedule.NUM_COMPUTE_WGS + 1,  # + the TMA (memory) warpgroup
      thread_name="wg",
      compiler_params=_compiler_params(),
      kernel_name=name,
  )


def _no_recv(body, x, w, out, stage=None):
  body(x, w, out, None, stage)


def _exchange_buffers(lead: tuple[int, ...], num_devices: int, chunk: int, n: int,
                      config: Config) -> tuple[jax.ShapeDtypeStruct, ...]:
  """The receive slots [*lead, slots, chunk, n] (`Config.receive_slots`; none if 0) and the
  staging buffer [*lead, D - 1, chunk, n] where remote tiles are staged (`Config.staged`), in
  the config's partial dtype: extra kernel outputs (uninitialised), because peers can only
  address kernel arguments (docs/design.md section 7)."""
  def buf(slots):
    return jax.ShapeDtypeStruct((*lead, slots, chunk, n), jnp.dtype(config.partial_dtype))
  slots = config.receive_slots(num_devices)
  recv = (buf(slots),) if slots else ()
  return (*recv, buf(num_devices - 1)) if config.staged else recv


def fused_matmul_reduce_scatter(x, w, *, axis_name, num_devices: int,
                                config: Config | None = None, ablate=(),
                                unverified: bool = False) -> jax.Array:
  """Inside shard_map over `axis_name` (size num_devices): x [m, k_shard], w [k_shard, n]
  -> [m // num_devices, n] (row chunk `axis_index` of sum over devices of x @ w).

  The mesh may have other axes, all manual in the shard_map: the sum runs over the devices
  that share this device's coordinates on them (its group); `check_mesh` says what runs.

  `ablate` (rank.ABLATIONS: "comm", "reduce", "gemm"): leave a stage out, for timing only;
  the result is then wrong
  (rank.Hooks says what each leaves out). `unverified`: as in `check_supported`, for
  experiments only."""
  m, k_shard = x.shape
  n = w.shape[1]
  if isinstance(config, CheckedConfig):
    axis = _reduced_axis(axis_name)
  else:
    axis = check_mesh(axis_name)
  config = _checked(config, m=m, k_shard=k_shard, n=n, dtype=x.dtype, num_devices=num_devices,
                    unverified=unverified)
  chunk = m // num_devices
  out_type = (jax.ShapeDtypeStruct((chunk, n), x.dtype),)
  if num_devices > 1:
    out_type += _exchange_buffers((), num_devices, chunk, n, config)
  f = _build(transport_lib.NVLinkTransport(axis, num_devices), out_type=out_type,
             config=config, num_devices=num_devices, name="pallas_rs_matmul_rs",
             skip=_skip(ablate))
  return f(x, w)[0]


def local_matmul(x, w, *, config: Config | None = None, ablate=()) -> jax.Array:
  """The kernel at D = 1 on one GPU, outside shard_map: x [m, k] @ w [k, n] -> [m, n].
  `ablate` (rank.ABLATIONS; at D = 1 "gemm" and "store" matter): timing only."""
  m, k = x.shape
  n = w.shape[1]
  config = _checked(config, m=m, k_shard=k, n=n, dtype=x.dtype, num_devices=1)
  f = _build(transport_lib.NVLinkTransport("_unused", 1),
             out_type=(jax.ShapeDtypeStruct((m, n), x.dtype),), config=config, num_devices=1,
             name="pallas_rs_local_matmul", skip=_skip(ablate))
  return f(x, w)[0]


def loopback_matmul_reduce_scatter(xs, ws, *, config: Config | None = None,
                                   ablate=()) -> jax.Array:
  """D virtual ranks on one GPU, the real protocol: xs [D, m, k_shard], ws [D, k_shard, n]
  -> [D, m // D, n] where out[r] is row chunk r of sum_s xs[s] @ ws[s]. `ablate` as in
  fused_matmul_reduce_scatter (timing only)."""
  d, m, k_shard = xs.shape
  n = ws.shape[2]
  if ws.shape[:2] != (d, k_shard):
    raise ValueError(f"xs {xs.shape} and ws {ws.shape} must be [D, m, k_shard], [D, k_shard, n]")
  config = _checked(config, m=m, k_shard=k_shard, n=n, dtype=xs.dtype, num_devices=d,
                    loopback=True)
  if d < 2:
    raise NotImplementedError("loopback needs at least 2 virtual ranks; use local_matmul")
  if config.num_sms < d:
    raise NotImplementedError(f"loopback needs num_sms >= D, got {config.num_sms=}, {d=}")
  chunk = m // d
  out_type = (jax.ShapeDtypeStruct((d, chunk, n), xs.dtype),
              *_exchange_buffers((d,), d, chunk, n, config))
  f = _build(transport_lib.LoopbackTransport(d), out_type=out_type, config=config,
             num_devices=d, name="pallas_rs_loopback", skip=_skip(ablate))
  return f(xs, ws)[0]


def rank_alone(x, w, *, num_devices: int, rank: int = 0, config: Config | None = None,
               ablate=("comm",)) -> jax.Array:
  """Timing only, on one GPU: rank `rank`'s program of the D-device kernel on all of this GPU's
  CTAs, outside shard_map and with no peers: x [m, k_shard], w [k_shard, n] -> [m // D, n]
  (not the reduce-scatter). `ablate` must contain "comm" (every partial tile is stored into this
  rank's own buffers; nothing is signalled or awaited); with "reduce" too it is the GEMM core in
  the kernel's chunked tile walk. So it measures a GPU of a D-device run without NVLink, the
  waits and XLA's barrier before a collective kernel: with the chunk, tile and pair structure
  of D devices, which `local_matmul` (D = 1) lacks."""
  skip = _skip(ablate)
  if "comm" not in skip:
    raise ValueError(f"rank_alone runs without peers: ablate must contain 'comm', got {ablate=}")
  if not 2 <= num_devices <= MAX_DEVICES or not 0 <= rank < num_devices:
    raise ValueError(f"rank_alone needs 2 <= num_devices <= {MAX_DEVICES} and 0 <= rank < "
                     f"num_devices, got {num_devices=}, {rank=}")
  m, k_shard = x.shape
  n = w.shape[1]
  # No peers: nothing to stall on (nvlink_unverified) and no remote loads.
  config = _checked(config, m=m, k_shard=k_shard, n=n, dtype=x.dtype, num_devices=num_devices,
                    alone=True)
  chunk = m // num_devices
  out_type = (jax.ShapeDtypeStruct((chunk, n), x.dtype),
              *_exchange_buffers((), num_devices, chunk, n, config))
  f = _build(transport_lib.AloneTransport("_alone", num_devices, rank), out_type=out_type,
             config=config, num_devices=num_devices, name="pallas_rs_rank_alone", skip=skip)
  return f(x, w)[0]
