"""How ranks reach each other: real devices over NVLink, or virtual ranks on one GPU.

Both expose the same small interface to body.py (docs/design.md section 4); a third,
AloneTransport, runs one rank's program with no peers, for timing on one GPU. Peers are always
named by a *static* offset `o` (destination `(rank + o) % D`), because a TMA store to a peer
builds its descriptor on the host, which can only recompute the peer id from arithmetic on
`lax.axis_index`.

Semaphores: one array per rank `[rows, cols, wg]`, zeroed by XLA on every call; the kernel
owns the layout (`schedule.SemLayout`) and names an entry by `(row, col, wg)`. Signals to a
peer use system scope (they order NVLink writes); a rank's own staging flags use GPU scope,
which costs less and is all that a store and a load on one GPU need.
"""
from __future__ import annotations

import dataclasses

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax
import jax.numpy as jnp

from pallas_rs.kernel.schedule import NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class NVLinkTransport:
  """One rank per device of the `axis_name` mesh axis (inside shard_map).

  Kernel arguments are this device's arrays; the receive buffer is [D - 1, m // D, n]; peers'
  buffers and semaphores are reached through collective metadata (`plgpu.remote_ref`).
  """
  axis_name: str
  num_devices: int

  def grid(self, num_sms: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    return (num_sms,), ("cluster_grid",)

  def rank(self):
    if self.num_devices == 1:
      return 0
    return lax.axis_index(self.axis_name)

  def bind(self, rank, *refs):
    """This rank's view of the kernel's arguments (None stays None)."""
    del rank
    return refs

  def _device_id(self, rank, offset: int):
    """The device id of the peer `offset` steps along `axis_name`, for every remote call.

    Mesh coordinates naming that axis only: Mosaic GPU fills every other mesh axis with the
    caller's own coordinate, so on a multi-axis mesh the peers stay in the caller's group (a
    scalar id is a position on the whole mesh and does not lower on an N-D mesh). On a 1-D mesh
    it lowers to the same module as the scalar id did (tests/test_mesh2d.py).
    """
    return {self.axis_name: lax.rem(rank + offset, self.num_devices)}

  def peer(self, ref, rank, offset: int):
    """The peer's (at `offset`) copy of kernel buffer `ref` (receive slots, staging, output)."""
    return plgpu.remote_ref(ref, self._device_id(rank, offset))

  def semaphores(self, shape: tuple[int, int]):
    return pl.get_global(plgpu.SemaphoreType.REGULAR((*shape, NUM_COMPUTE_WGS)))

  def signal(self, sems, rank, offset: int, idx, inc=1):
    """Adds `inc` to entry `idx` of the peer at `offset` (after this warpgroup's writes)."""
    pl.semaphore_signal(sems.at[idx], inc, device_id=self._device_id(rank, offset))

  def signal_local(self, sems, rank, idx, inc=1):
    del rank
    plgpu.semaphore_signal(sems.at[idx], inc, memory_scope="gpu")

  def wait(self, sems, rank, idx, value, *, local: bool = False):
    """Waits until this rank's entry `idx` reaches `value` (monotone targets);
    local=True: only this GPU's CTAs signal it."""
    del rank
    plgpu.semaphore_wait(sems.at[idx], value, decrement=False,
                         memory_scope="gpu" if local else "sys")


@dataclasses.dataclass(frozen=True)
class LoopbackTransport:
  """D virtual ranks on one GPU: rank r is the CTAs with grid index r along axis "rank".

  Kernel arguments are stacked over ranks: x [D, m, k_shard], w [D, k_shard, n],
  out [D, m // D, n], recv [D, D - 1, m // D, n], stage [D, D - 1, m // D, n]; semaphores are
  indexed by rank. All `num_sms` CTAs must be resident at once (one per SM), or a rank could
  wait on a rank that never gets scheduled: the grid is exactly `num_sms // D` CTAs per rank.
  """
  num_devices: int

  def grid(self, num_sms: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    return (self.num_devices, num_sms // self.num_devices), ("rank", "cluster_grid")

  def rank(self):
    return lax.axis_index("rank")

  def bind(self, rank, *refs):
    return tuple(None if a is None else a.at[rank] for a in refs)

  def _peer(self, rank, offset: int):
    return lax.rem(rank + offset, self.num_devices)

  def peer(self, ref, rank, offset: int):
    return ref.at[self._peer(rank, offset)]

  def semaphores(self, shape: tuple[int, int]):
    return pl.get_global(plgpu.SemaphoreType.REGULAR(
        (self.num_devices, *shape, NUM_COMPUTE_WGS)))

  def signal(self, sems, rank, offset: int, idx, inc=1):
    pl.semaphore_signal(sems.at[(self._peer(rank, offset), *idx)], inc)

  def signal_local(self, sems, rank, idx, inc=1):
    plgpu.semaphore_signal(sems.at[(rank, *idx)], inc, memory_scope="gpu")

  def wait(self, sems, rank, idx, value, *, local: bool = False):
    plgpu.semaphore_wait(sems.at[(rank, *idx)], value, decrement=False,
                         memory_scope="gpu" if local else "sys")


@dataclasses.dataclass(frozen=True)
class AloneTransport(NVLinkTransport):
  """Timing only: rank `rank_index` of D, alone on one GPU with all of its CTAs, as it would run
  on a node, with no peers. Only the kernel's "comm" ablation runs on it (every partial stays
  in this rank's own buffers; no signal, wait or remote reference), so what it times is one
  GPU's share of a D-device call without NVLink, its waits and XLA's barrier
  (`fused.rank_alone`). Kernel arguments as NVLinkTransport's."""
  rank_index: int = 0

  def rank(self):
    return jnp.int32(self.rank_index)

  def _device_id(self, rank, offset: int):
    raise AssertionError("AloneTransport has no peers: the kernel must run with ablate 'comm'")

  def signal(self, sems, rank, offset: int, idx, inc=1):
    self._device_id(rank, offset)

  def wait(self, sems, rank, idx, value, *, local: bool = False):
    if not local:  # (Local waits are the split's hand-off, between this rank's own CTAs.)
      raise AssertionError("AloneTransport has no peers: the kernel must run with ablate 'comm'")
    super().wait(sems, rank, idx, value, local=True)
