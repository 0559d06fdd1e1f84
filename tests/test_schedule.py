"""The communication schedule as data (schedule.py): the protocol the kernel runs, checked on CPU."""
import collections

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest

from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import defaults
from pallas_rs.kernel import schedule
from pallas_rs.kernel import simulator
from pallas_rs.bench import shapes

SEEDS = shapes.select(tags="seed")


def _tiles(case, d):
  """(tiles per step, chunk group, interleaved walk) of the default config for the case at
  D = d."""
  cfg = defaults.default_config(m=case.m, n=case.n, k_shard=case.k // d, num_devices=d)
  group = cfg.chunk_group(case.m, d)
  return ((group * case.m // d // cfg.cta_tile_m) * (case.n // cfg.cta_tile_n), group,
          cfg.interleave_steps)


def _check(d, tiles, num_ctas, comm_ctas=0, eager=0, pull=False, group=1, interleave=False):
  if isinstance(tiles, tuple):
    tiles, group, interleave = tiles
  result = simulator.simulate(num_ctas=num_ctas, num_devices=d, tiles_per_chunk=tiles,
                             comm_ctas=comm_ctas, eager_signal_steps=eager, pull=pull,
                             group=group, interleave=interleave)
  trace = result["trace"]
  computed = collections.Counter((e.rank, e.dst, e.tile) for e in trace if e.kind == "compute")
  # Every rank computes every tile of every chunk (group) exactly once.
  assert set(computed.values()) == {1}
  assert len(computed) == d * schedule.num_steps(d, group) * tiles
  if comm_ctas and d > 1:  # ... on compute CTAs only (grid indices comm_ctas and up).
    assert all(e.cta >= comm_ctas for e in trace if e.kind == "compute")
    assert not any(e.kind == "compute" for e in simulator.cta_program(
        0, 0, num_ctas=num_ctas, num_devices=d, tiles_per_chunk=tiles, comm_ctas=comm_ctas))
  # Every output tile is produced (reduced) exactly once, by its owner.
  reduced = collections.Counter((e.rank, e.tile) for e in trace if e.kind == "reduce")
  assert set(reduced.values()) == {1} and len(reduced) == d * tiles
  # Every receive slot is written exactly once, with the partial of the source it names:
  # pushed by that source, or pulled from it by the owner.
  writes = [(e.dst, e.rank) if e.kind == "store" else (e.rank, e.dst)  # (owner, source)
            for e in trace if (e.kind == "store" and e.slot >= 0) or e.kind == "pull"]
  slots = [(e, w) for e, w in zip([e for e in trace if (e.kind == "store" and e.slot >= 0)
                                   or e.kind == "pull"], writes)]
  stores = collections.Counter((owner, e.slot, e.tile) for e, (owner, _) in slots)
  assert set(stores.values()) == {1} and len(stores) == d * (d - 1) * tiles
  for e, (owner, source) in slots:
    assert schedule.source_of_slot(owner, e.slot, d) == source
  assert not pull or all(e.kind == "pull" for e, _ in slots)
  staged = collections.Counter((e.rank, e.slot, e.tile) for e in trace if e.kind == "stage")
  if comm_ctas and d > 1:  # Every remote tile is staged once, then pushed once.
    assert set(staged.values()) == {1} and len(staged) == d * (d - 1) * tiles
  else:
    assert not staged
  # Each wait's target equals the signals that reach its semaphore: no more, no fewer.
  sems = result["semaphores"]
  if comm_ctas and d > 1:
    # Comm CTA c of each source delivers its tiles c, c + n, ... of every slot, all counted.
    delivered = {k[1:]: v for k, v in sems.items() if k[0] == "delivered"}
    expect = {(r, s, c, wg): len(range(c, tiles, comm_ctas)) for r in range(d)
              for s in range(d - 1) for c in range(min(comm_ctas, tiles))
              for wg in range(schedule.NUM_COMPUTE_WGS)}
    assert delivered == expect
    top = collections.defaultdict(int)  # The owner's largest target per counter.
    for e in trace:
      if e.kind == "wait_delivered":
        key = (e.rank, e.slot, e.tile % comm_ctas)
        top[key] = max(top[key], e.target)
    assert top == {k[:3]: v for k, v in expect.items()}
  else:
    waits = {(e.rank, e.tile): e.target for e in trace if e.kind == "wait"}
    owner = {k: v for k, v in sems.items() if k[0] != "staged"}
    for (rank, tile, wg), value in owner.items():
      assert value == waits[(rank, tile)] == d - 1, (rank, tile, wg)
    # Pairs: only the warpgroup that holds the owner's chunk is signalled.
    assert len(owner) == d * tiles * (schedule.NUM_COMPUTE_WGS if group == 1 else 1)
  for key, value in sems.items():
    if key[0] == "staged":
      assert value == 1, key  # One staging signal per tile and warpgroup, one wait for it.


# M = 32768 (1.3-1.8 s each on 2 CPU cores) in the slow layer (tests/conftest.py): the path of
# M = 8192 with four times the tiles.
@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.name, marks=pytest.mark.slow if c.m == 32768 else ()) for c in SEEDS])
def test_seed_shapes_d8_nvlink(case):
  _check(8, _tiles(case, 8), num_ctas=config_lib.DEFAULT_NUM_SMS)


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("name", ["llama70b_o_proj_m512", "mixtral8x22b_w2_m2048",
                                  "llama70b_down_proj_m8192"])
def test_loopback_and_small_d(name, d):
  case = shapes.by_name(name)
  tiles = _tiles(case, d)
  _check(d, tiles, num_ctas=config_lib.DEFAULT_NUM_SMS // d)  # loopback: CTAs split by rank
  _check(d, tiles, num_ctas=config_lib.DEFAULT_NUM_SMS)


@pytest.mark.parametrize("d,tiles,ctas", [(2, 1, 1), (8, 3, 5), (4, 7, 64), (8, 1, 132)])
def test_awkward_grids(d, tiles, ctas):
  _check(d, tiles, ctas)


@pytest.mark.parametrize("d,tiles,ctas", [(3, 5, 4), (4, 7, 64), (8, 32, 132), (8, 1, 5)])
@pytest.mark.parametrize("comm,pull", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("eager", [0, 1])
def test_interleaved_walk(d, tiles, ctas, comm, pull, eager):
  """Config.interleave_steps: the same protocol in another order, deadlock-free and complete,
  with the direct push, comm CTAs and eager slots; pairs below."""
  _check(d, tiles, ctas, comm_ctas=comm, eager=eager, pull=pull, interleave=True)


@pytest.mark.parametrize("d,ctas", [(4, 3), (8, 66), (8, 132)])
def test_interleaved_pairs(d, ctas):
  _check(d, 32, ctas, group=2, interleave=True)


@pytest.mark.parametrize("d,tiles", [(2, 5), (3, 4), (8, 32)])
def test_interleaved_walk_order(d, tiles):
  walk = [schedule.step_and_tile(i, tiles, d, True) for i in range(d * tiles)]
  assert sorted(walk) == [(s, t) for s in range(d) for t in range(tiles)]  # each tile once
  remote = (d - 1) * tiles
  assert all(s == d - 1 for s, _ in walk[remote:])  # the own step last, as step-major
  if d > 2:  # the remote steps tile by tile, step fastest
    assert walk[:d - 1] == [(s, 0) for s in range(d - 1)]
  else:  # one remote step: nothing to interleave
    assert walk == [schedule.step_and_tile(i, tiles) for i in range(d * tiles)]
  traced = jax.jit(jax.vmap(lambda i: jnp.stack(schedule.step_and_tile(i, tiles, d, True))))(
      jnp.arange(d * tiles, dtype=jnp.int32))
  assert [tuple(map(int, st)) for st in traced] == walk  # the kernel's form agrees


def test_interleaved_walk_is_the_default_for_one_row_chunks():
  # BUILD_NOTES 2026-12-01 eighth session: 17-22% off a D = 8 M = 512 rank's GEMM core alone.
  cases = {(8, 512): True, (4, 512): True, (8, 2048): False, (4, 2048): False, (2, 512): False}
  for (d, m), want in cases.items():
    cfg = defaults.default_config(m=m, n=8192, k_shard=1024, num_devices=d)
    assert cfg.interleave_steps == want, (d, m, cfg)
    assert want == (cfg.chunk_group(m, d) * m // d == cfg.cta_tile_m)  # one row per step


@pytest.mark.parametrize("grid", [(8, 8), (5, 7), (64, 32), (3, 24), (1, 32)])
@pytest.mark.parametrize("minor", [0, 1])
@pytest.mark.parametrize("width", [1, 3, 8])
def test_snake_tile_is_the_kernels_order(grid, minor, width):
  lin = jnp.arange(grid[0] * grid[1], dtype=jnp.int32)
  m_idx, n_idx = jax.vmap(lambda i: plgpu.planar_snake(i, grid, minor, width))(lin)
  mine = [schedule.snake_tile(i, grid, minor, width) for i in range(grid[0] * grid[1])]
  assert mine == list(zip(m_idx.tolist(), n_idx.tolist()))


def test_wave_footprint():
  # 132 tiles of 128 x 256 over a 64 x 32 grid: column bands cover 64 rows and 3 columns,
  # row bands 8 high cover 8 rows and 17 columns.
  assert schedule.wave_footprint((64, 32), 128, 256, 1, 1, 132) == 64 * 128 + 3 * 256
  assert schedule.wave_footprint((64, 32), 128, 256, 0, 8, 132) == 8 * 128 + 17 * 256
  assert schedule.wave_footprint((1, 4), 64, 256, 1, 1, 132) == 64 + 4 * 256  # < one wave


def test_default_tile_order_follows_the_footprint():
  # BUILD_NOTES 2026-12-01 eleventh session: row bands 4-17% faster one rank alone at D = 4,
  # M = 32768 and 1-12% over GEMMs of 48-128 rows of tiles; within 2% where the footprint
  # model sees no difference (32 rows or fewer: D = 8 M = 32768, D = 4 M = 8192).
  want_rows = {(4, 32768): True, (2, 32768): True, (2, 12288): True, (1, 6144): True,
               (4, 8192): False, (8, 32768): False, (8, 8192): False, (8, 512): False,
               (2, 2048): False, (1, 4096): False}
  for (d, m), rows in want_rows.items():
    for n, k in ((8192, 28672), (6144, 6144)):
      cfg = defaults.default_config(m=m, n=n, k_shard=k // d, num_devices=d)
      order = (cfg.grid_minor_dim.name, cfg.grid_tile_width)
      assert order == (("M", 8) if rows else ("N", 1)), (d, m, n, order)


def test_stagger_order():
  # Rank r computes the chunk of r-1 first and its own chunk last.
  events = simulator.cta_program(3, 0, num_ctas=1, num_devices=4, tiles_per_chunk=1)
  dsts = [e.dst for e in events if e.kind == "compute"]
  assert dsts == [2, 1, 0, 3]


def test_signal_is_deferred_until_next_tile():
  events = simulator.cta_program(0, 0, num_ctas=1, num_devices=2, tiles_per_chunk=2)
  kinds = [(e.kind, e.step, e.tile) for e in events]
  # The store of remote tile 0 is announced after tile 1's mainloop, not right after the store.
  assert kinds.index(("signal", 0, 0)) > kinds.index(("compute", 0, 1))


def test_detects_missing_signal(monkeypatch):
  orig = simulator.cta_program

  def drop_last_signal(*args, **kwargs):
    events = orig(*args, **kwargs)
    if args[0] == 1 and args[1] == 0:
      idx = max(i for i, e in enumerate(events) if e.kind == "signal")
      del events[idx]
    return events

  monkeypatch.setattr(simulator, "cta_program", drop_last_signal)
  with pytest.raises(RuntimeError, match="deadlock"):
    simulator.simulate(num_ctas=1, num_devices=2, tiles_per_chunk=2)


@pytest.mark.parametrize("eager", [1, 2, 7, 20])
@pytest.mark.parametrize("d,tiles,ctas", [(8, 32, 132), (4, 7, 5), (2, 3, 1), (8, 64, 16)])
def test_eager_signal_variants(d, tiles, ctas, eager):
  _check(d, tiles, ctas, eager=eager)


def test_eager_signal_follows_the_store():
  events = simulator.cta_program(0, 0, num_ctas=1, num_devices=2, tiles_per_chunk=2,
                                eager_signal_steps=1)
  kinds = [(e.kind, e.step, e.tile) for e in events]
  # Step 0 is the last remote step at D = 2: each store is announced right away.
  assert kinds.index(("signal", 0, 0)) == kinds.index(("store", 0, 0)) + 1
  assert kinds.index(("signal", 0, 0)) < kinds.index(("compute", 0, 1))
  assert sum(k == "signal" for k, _, _ in kinds) == 2


@pytest.mark.parametrize("d,tiles,ctas,comm", [
    (2, 64, 132, 2), (2, 1024, 132, 4), (8, 16, 132, 8), (4, 7, 64, 3), (8, 3, 16, 1),
    (2, 1, 4, 2), (8, 1, 132, 16)])
@pytest.mark.parametrize("eager", [0, 1])
@pytest.mark.parametrize("pull", [False, True])
def test_comm_ctas(d, tiles, ctas, comm, eager, pull):
  """Staging + dedicated comm CTAs, pushing or pulling: no deadlock, every tile staged, moved
  and announced once, including comm CTAs with no tile (comm > tiles) and the lag's drain."""
  _check(d, tiles, ctas, comm_ctas=comm, eager=eager, pull=pull)


def test_pull_exit_handshake_is_needed(monkeypatch):
  """Signalling 'done' before the pulls lets a peer exit while still being read: caught."""
  real = simulator._pull_program  # pylint: disable=protected-access

  def early_done(*args, **kwargs):
    events = real(*args, **kwargs)
    done = [e for e in events if e.kind in ("signal_done", "wait_done")]
    return done + [e for e in events if e.kind not in ("signal_done", "wait_done")]

  monkeypatch.setattr(simulator, "_pull_program", early_done)
  with pytest.raises(RuntimeError, match="after it exited"):
    simulator.simulate(num_ctas=8, num_devices=2, tiles_per_chunk=32, comm_ctas=2, pull=True)


@pytest.mark.parametrize("sets", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [1, 2, 5, 17])
def test_pull_buffer_reuse(sets, count):
  """A model of a pulling warpgroup (kernel.pull_program): loads run `prefetch` blocks ahead
  into buffer j % sets, each after waiting until at most `reuse_wait` local stores are unread;
  no load may overwrite a buffer whose store is still unread, every block is loaded before
  its store."""
  prefetch, reuse_wait = schedule.comm_prefetch(sets)
  assert 1 <= prefetch and 0 <= reuse_wait < sets
  unread, loaded = [], {}

  def load(j):
    while len(unread) > reuse_wait:
      unread.pop(0)
    assert all(t % sets != j % sets for t in unread), (j, unread)
    loaded[j] = j % sets

  for j in range(min(prefetch, count)):
    load(j)
  for j in range(count):
    assert j in loaded
    unread.append(j)
    if j + prefetch < count:
      load(j + prefetch)


def test_comm_ctas_need_a_compute_cta():
  with pytest.raises(ValueError, match="leaves no compute CTA"):
    simulator.simulate(num_ctas=4, num_devices=2, tiles_per_chunk=3, comm_ctas=4)


@pytest.mark.parametrize("pull", [False, True])
def test_move_before_staging_is_caught(monkeypatch, pull):
  """The simulator's check is live: a comm CTA that skips its wait moves unstaged data."""
  name = "_pull_program" if pull else "_comm_program"
  real = getattr(simulator, name)

  def no_wait(*args, **kwargs):
    return [e for e in real(*args, **kwargs) if e.kind != "wait_staged"]

  monkeypatch.setattr(simulator, name, no_wait)
  with pytest.raises(RuntimeError, match="before it was staged"):
    simulator.simulate(num_ctas=8, num_devices=2, tiles_per_chunk=32, comm_ctas=2, pull=pull)


@pytest.mark.parametrize("sets", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [1, 2, 5, 17])
def test_comm_buffer_reuse(sets, count, reuse_wait=None):
  """A model of one comm warpgroup's loop (kernel.comm_program): block j is written into
  buffer j % sets after waiting until at most `reuse_wait` TMA stores may still read SMEM;
  worst case, a store reads its buffer only when a wait forces it. No block may overwrite a
  buffer whose store is still unread."""
  reuse_wait = schedule.comm_reuse_wait(sets) if reuse_wait is None else reuse_wait
  unread = []  # blocks whose TMA store may still read their buffer, oldest first
  for j in range(count):
    while len(unread) > reuse_wait:
      unread.pop(0)
    assert all(t % sets != j % sets for t in unread), (j, unread)
    unread.append(j)  # the store of block j


def test_comm_buffer_reuse_model_catches_a_short_wait():
  with pytest.raises(AssertionError):
    test_comm_buffer_reuse(3, 5, reuse_wait=3)


def test_delivery_before_landing_is_caught(monkeypatch):
  """A comm CTA that announces a batch before its stores land is caught by the simulator."""
  real = simulator._comm_program  # pylint: disable=protected-access

  def early(*args, **kwargs):
    events = real(*args, **kwargs)
    delivers = [e for e in events if e.kind == "deliver"]
    rest = [e for e in events if e.kind != "deliver"]
    return delivers + rest

  monkeypatch.setattr(simulator, "_comm_program", early)
  with pytest.raises(RuntimeError, match="before it landed"):
    simulator.simulate(num_ctas=8, num_devices=2, tiles_per_chunk=32, comm_ctas=2)


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("ctas,tiles", [(1, 1), (2, 5), (3, 32), (132, 32), (16, 7)])
def test_pairs_deliver_every_warpgroup_tile_once(d, ctas, tiles):
  # chunk_group 2: each warpgroup of a tile has its own destination; the owner's warpgroup
  # r % 2 of every tile gets D - 1 signals, the other none; no deadlock (the remote half
  # beside the own chunk signals at once: tests below).
  result = simulator.simulate(num_ctas=ctas, num_devices=d, tiles_per_chunk=tiles, group=2)
  sems = result["semaphores"]
  for r in range(d):
    for t in range(tiles):
      assert sems.get((r, t, r % 2), 0) == d - 1
      assert sems.get((r, t, 1 - r % 2), 0) == 0
  reduces = [e for e in result["trace"] if e.kind == "reduce"]
  assert sorted((e.rank, e.tile, e.wg) for e in reduces) == sorted(
      (r, t, r % 2) for r in range(d) for t in range(tiles))


def test_pairs_walk_every_chunk_once_own_pair_last():
  d = 8
  for r in range(d):
    dsts = [schedule.wg_dst(r, s, wg, d, 2) for s in range(schedule.num_steps(d, 2))
            for wg in (0, 1)]
    assert sorted(dsts) == list(range(d))
    assert r in dsts[-2:]  # the own pair last
    # The group formula at g = 1 is the plain stagger: step s computes chunk r - s - 1.
    assert all(schedule.wg_dst(r, s, 0, d, 1) == (r - s - 1) % d for s in range(d))


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_partials_arrive_in_ring_order(d):
  """Owner r receives at step s from source r + s + 1 (source_offset), into the slot that
  names it, so the steps visit ring_slots in order: what lets pulling comm CTAs add the
  partials as they come in the unfused path's order (Config.tma_add at D > 2)."""
  for r in range(d):
    arrivals = []
    for s in range(d - 1):
      src = (r + schedule.source_offset(s)) % d
      assert schedule.wg_dst(src, s, 0, d) == r  # that source computes r's chunk at step s
      offset = (r - src) % d
      assert schedule.remote_step(offset, d) == s
      arrivals.append(schedule.recv_slot(offset))
      assert schedule.source_of_slot(r, arrivals[-1], d) == src
    assert tuple(arrivals) == schedule.ring_slots(d)


@pytest.mark.parametrize("d,tiles,ctas,comm", [(3, 5, 8, 2), (4, 6, 9, 3), (8, 4, 12, 4)])
def test_ring_chain_pulls_in_ring_order(d, tiles, ctas, comm):
  """The simulator's ring_chain check holds for the pull program (each comm CTA walks the steps
  in order) and fails when the owner's slots are visited against ring order."""
  simulator.simulate(num_ctas=ctas, num_devices=d, tiles_per_chunk=tiles, comm_ctas=comm,
                     pull=True, ring_chain=True)
  reversed_order = lambda n: tuple(reversed(schedule.ring_slots(n)))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(simulator, "ring_slots", reversed_order)
    with pytest.raises(RuntimeError, match="ring order"):
      simulator.simulate(num_ctas=ctas, num_devices=d, tiles_per_chunk=tiles, comm_ctas=comm,
                         pull=True, ring_chain=True)


def test_tile_counts_of_a_walk():
  # D = 2, M = 2048, 128 x 256 CTA tiles: 8 x 32 per 1024-row chunk, 2 steps.
  assert schedule.tile_grid(1024, 8192, 128, 256) == (8, 32)
  assert schedule.total_tiles(1024, 8192, 128, 256, 2) == 512
  # Pairs (D = 8, M = 512): one 128-row tile over two 64-row chunks, 4 pair steps.
  assert schedule.tile_grid(64, 8192, 128, 256, group=2) == (1, 32)
  assert schedule.total_tiles(64, 8192, 128, 256, 8, group=2) == 4 * 32


def test_pairs_remote_half_beside_the_own_chunk_announces_before_the_own_half_waits():
  # body.deferred: deferred to the CTA's next tile, whose mainloop needs the own warpgroup
  # (stuck in its owner wait), that signal would leave partners waiting in a cycle.
  events = simulator.cta_program(0, 0, num_ctas=1, num_devices=2, tiles_per_chunk=2, group=2)
  signal = [i for i, e in enumerate(events) if e.kind == "signal"]
  wait = [i for i, e in enumerate(events) if e.kind == "wait"]
  assert signal[0] < wait[0]  # the remote half announces before the own half waits


def _owner_pull(d, tiles, ctas, **kw):
  return simulator.simulate(num_ctas=ctas, num_devices=d, tiles_per_chunk=tiles,
                            owner_pull=True, **kw)


@pytest.mark.parametrize("d,tiles,ctas", [(2, 64, 132), (2, 3, 1), (4, 7, 5), (8, 32, 132),
                                          (8, 3, 16), (3, 5, 4)])
@pytest.mark.parametrize("eager", [0, 1])
@pytest.mark.parametrize("interleave", [False, True])
def test_owner_pull(d, tiles, ctas, eager, interleave):
  """comm_mode "owner": every remote tile staged once and flagged to its owner; every own tile
  pulls each source's partial once, after its flag, into the slot naming that source; every
  rank's staging outlives its readers (the done handshake); no deadlock."""
  trace = _owner_pull(d, tiles, ctas, eager_signal_steps=eager, interleave=interleave)["trace"]
  staged = collections.Counter((e.rank, e.slot, e.tile) for e in trace if e.kind == "stage")
  assert set(staged.values()) == {1} and len(staged) == d * (d - 1) * tiles
  pulls = collections.Counter((e.rank, e.slot, e.tile) for e in trace if e.kind == "pull")
  assert set(pulls.values()) == {1} and len(pulls) == d * (d - 1) * tiles
  for e in trace:
    if e.kind == "pull":
      assert schedule.source_of_slot(e.rank, e.slot, d) == e.dst
      assert schedule.wg_dst(e.dst, e.step, 0, d) == e.rank  # the source's step for this chunk
  assert not any(e.kind in ("store", "signal", "wait_delivered") for e in trace)
  reduced = collections.Counter((e.rank, e.tile) for e in trace if e.kind == "reduce")
  assert set(reduced.values()) == {1} and len(reduced) == d * tiles
  last_pull = {r: max(i for i, e in enumerate(trace) if e.kind == "pull" and e.dst == r)
               for r in range(d)}
  for i, e in enumerate(trace):
    if e.kind == "wait_done":  # a rank exits only after the last read of its staging
      assert i > last_pull[e.rank]


@pytest.mark.parametrize("drop,match", [("wait_staged", "before it was staged"),
                                        ("signal_done", "deadlock")])
def test_owner_pull_checks_are_live(monkeypatch, drop, match):
  real = simulator.cta_program

  def without(*args, **kwargs):
    return [e for e in real(*args, **kwargs) if e.kind != drop]

  monkeypatch.setattr(simulator, "cta_program", without)
  with pytest.raises(RuntimeError, match=match):
    _owner_pull(4, 6, 5)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_pairs_along_n_send_each_half_where_the_m_split_sends_its_warpgroup(d):
  # Pairs along N (Rank.parts): each warpgroup's two 64-row halves go where the M split sends
  # its two warpgroups, so both splits put every element in the same place; over a rank's walk
  # each chunk is reached once per half-row block, its own half only at the last (own pair)
  # step, where the other half goes to the pair partner.
  last = schedule.num_steps(d, 2) - 1
  for r in range(d):
    seen = []
    for s in range(last + 1):
      halves = [schedule.half_dst(r, s, h, d) for h in range(2)]
      assert halves == [schedule.wg_dst(r, s, wg, d, 2) for wg in range(2)]
      assert (r in halves) == (s == last)
      seen += halves
    assert sorted(seen) == list(range(d))
    assert schedule.half_dst(r, last, r % 2, d) == r
    assert schedule.half_dst(r, last, 1 - r % 2, d) == r ^ 1  # the partner
  # A 128-row tile along N over 64-row chunks is such a pair tile.
  cfg = config_lib.Config(tile_m=128, tile_n=128)
  assert cfg.chunk_group(64 * d, d) == 2
