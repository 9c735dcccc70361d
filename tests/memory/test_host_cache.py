"""The host cache: arenas (page-aligned, populated piecewise, over a file or anonymous), pools,
leases, and the engine's sizing of its cache."""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing
from helpers import (
    MARKS,
    assert_state_equal,
    clone_state,
    load_into,
    mounted_tmpfs,
    rand_tensor,
    run_script,
)

from dcp_datastates import DataStatesWriter, parse_size
from dcp_datastates._format.align import ALIGN
from dcp_datastates._format.data_file import LARGE_ITEM_BYTES
from dcp_datastates._memory.host_cache import MAP_PIECE, Arena, Lease, Pool
from dcp_datastates._sizes import format_size

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096

pytestmark = MARKS


@pytest.fixture(scope="module")
def arena() -> Arena:
    arena = Arena(1 * MiB, "snapshot")
    yield arena
    arena.free()


@pytest.fixture
def pool(arena: Arena) -> Pool:
    """The arena's pool, checked to be empty before and after each test."""
    assert arena.pool.used == 0 and arena.pool.live == 0
    yield arena.pool
    assert arena.pool.used == 0 and arena.pool.live == 0, "a test leaked leases"


@pytest.fixture
def sharing_strategy():
    """Set torch's sharing strategy for one test; the old one comes back afterwards."""
    old = torch.multiprocessing.get_sharing_strategy()
    yield torch.multiprocessing.set_sharing_strategy
    torch.multiprocessing.set_sharing_strategy(old)


# -- Arena ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", sorted(torch.multiprocessing.get_all_sharing_strategies()))
@pytest.mark.parametrize("nbytes", [PAGE, 5000, 1 * MiB + 1, 3 * MiB])
def test_arena_is_page_aligned_whatever_the_sharing_strategy(
    sharing_strategy, strategy: str, nbytes: int
) -> None:
    sharing_strategy(strategy)
    arena = Arena(nbytes, "test")
    try:
        assert arena.addr % PAGE == 0
        assert arena.nbytes == -(-nbytes // PAGE) * PAGE
        assert arena.pool.capacity == arena.nbytes and arena.pool.name == "test"
        lease = arena.pool.allocate(nbytes)
        try:
            t = lease.as_tensor()
            assert t.data_ptr() == arena.addr and t.numel() == nbytes
            t.fill_(0x5A)  # the memory is there and writable
            assert int(t[-1]) == 0x5A
        finally:
            lease.release()
    finally:
        arena.free()


def test_arena_too_small() -> None:
    with pytest.raises(ValueError, match=f"an arena needs at least {PAGE} bytes, got 100"):
        Arena(100, "test")


def test_other_threads_start_and_allocate_while_an_arena_is_populated() -> None:
    """The kernel holds the process's memory-map lock while it populates pages: a big arena
    populated in one go held every other thread's start and allocation until it was done."""
    made: list[Arena] = []
    maker = threading.Thread(target=lambda: made.append(Arena(2 << 30, "big")))
    maker.start()
    started = 0
    while maker.is_alive():
        thread = threading.Thread(target=bytearray, args=(1 << 22,))
        thread.start()
        thread.join()
        started += maker.is_alive()
    maker.join()
    made[0].free()
    assert started >= 3, f"only {started} thread(s) started while the arena was populated"


def test_slot_arena_keeps_the_bytes_of_its_file(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    path.write_bytes(b"\0" * (3 * PAGE) + b"kept" + b"\0" * (PAGE - 4))
    fd = os.open(path, os.O_RDWR)
    try:
        arena = Arena(4 * PAGE, "slot", fd=fd)
        assert bytes(arena.tensor[3 * PAGE: 3 * PAGE + 4].numpy()) == b"kept"
        arena.tensor[:4] = torch.tensor(list(b"new!"), dtype=torch.uint8)
        arena.free()
    finally:
        os.close(fd)
    assert path.read_bytes()[:4] == b"new!"


def test_arena_free_refuses_while_a_lease_is_live() -> None:
    arena = Arena(4 * PAGE, "snapshot")
    lease = arena.pool.allocate(PAGE)
    other = arena.pool.allocate(PAGE)
    other.release()
    with pytest.raises(
        RuntimeError, match=r"cannot free the snapshot cache: 1 lease\(s\) still live"
    ):
        arena.free()
    assert not arena.freed
    lease.as_tensor().fill_(1)  # still mapped: the refused free changed nothing
    lease.release()
    arena.free()
    assert arena.freed
    arena.free()  # idempotent


# -- Pool / Lease --------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 100, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17])
def test_leases_are_aligned_and_rounded(pool: Pool, size: int) -> None:
    leases = [pool.try_allocate(size) for _ in range(3)]
    try:
        for lease in leases:
            assert isinstance(lease, Lease)
            assert lease.addr % PAGE == 0 and lease.offset % PAGE == 0
            assert lease.nbytes == size
            assert lease.capacity == max(PAGE, -(-size // PAGE) * PAGE)
            assert lease.as_tensor().numel() == size
            if size:
                assert lease.as_tensor().data_ptr() == lease.addr
                assert lease.as_tensor(1, size - 1).data_ptr() == lease.addr + size - 1
        spans = sorted((lease.offset, lease.offset + lease.capacity) for lease in leases)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "overlap"
        assert pool.used == sum(lease.capacity for lease in leases)
        assert pool.live == 3
    finally:
        for lease in leases:
            lease.release()


def test_release_is_idempotent(pool: Pool) -> None:
    lease = pool.allocate(10)
    lease.release()
    lease.release()
    assert pool.used == 0 and pool.live == 0 and lease.released


def test_first_fit(pool: Pool) -> None:
    """A request takes the lowest free block large enough, not the best-fitting one."""
    a, b, c, d, rest = (pool.allocate(n * PAGE) for n in (2, 1, 3, 1, 1))
    rest2 = pool.try_allocate(pool.capacity - pool.used)
    try:
        assert pool.try_allocate(1) is None  # full
        a.release()  # hole of 2 pages at 0
        c.release()  # hole of 3 pages after b
        one = pool.allocate(PAGE)  # fits both holes: the first one
        assert one.offset == a.offset
        three = pool.allocate(3 * PAGE)  # only the second hole fits
        assert three.offset == c.offset
        also = pool.allocate(PAGE)  # the rest of the first hole
        assert also.offset == a.offset + PAGE
        assert pool.try_allocate(1) is None
        for lease in (one, three, also):
            lease.release()
    finally:
        for lease in (a, b, c, d, rest, rest2):
            if lease is not None:
                lease.release()


def test_free_blocks_merge(pool: Pool) -> None:
    quarter = pool.capacity // 4
    assert quarter % PAGE == 0
    a, b, c, d = (pool.allocate(quarter) for _ in range(4))
    assert pool.try_allocate(1) is None  # full
    a.release()
    c.release()
    # Two separate free quarters: half the pool does not fit yet.
    assert pool.try_allocate(2 * quarter) is None
    b.release()  # merges with both neighbours: a + b + c is one free block
    abc = pool.try_allocate(3 * quarter)
    assert abc is not None and abc.offset == a.offset
    abc.release()
    d.release()
    whole = pool.try_allocate(pool.capacity)  # everything back in one block
    assert whole is not None and whole.offset == a.offset
    whole.release()


@pytest.mark.parametrize("order", ["reverse", "forward", "interleaved"])
def test_merge_whatever_the_release_order(pool: Pool, order: str) -> None:
    leases = [pool.allocate(PAGE * 3) for _ in range(6)]
    if order == "reverse":
        leases.reverse()
    elif order == "interleaved":
        leases = leases[::2] + leases[1::2]
    for lease in leases:
        lease.release()
    whole = pool.try_allocate(pool.capacity)
    assert whole is not None and whole.offset == 0
    whole.release()


def test_allocate_blocks_until_a_release_from_another_thread(pool: Pool) -> None:
    hog = pool.allocate(pool.capacity)
    got: list[Lease] = []
    waiter = threading.Thread(target=lambda: got.append(pool.allocate(5 * PAGE)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not got, "allocate should wait while the pool is full"
    releaser = threading.Thread(target=hog.release)
    releaser.start()
    releaser.join(10)
    waiter.join(10)
    assert not waiter.is_alive()
    (lease,) = got
    assert lease.capacity == 5 * PAGE and lease.offset == 0
    lease.release()


def test_oversize_request(pool: Pool) -> None:
    capacity = re.escape(format_size(pool.capacity))
    with pytest.raises(ValueError, match=rf"does not fit in the snapshot pool of {capacity}"):
        pool.allocate(pool.capacity + 1)
    assert pool.try_allocate(pool.capacity + 1) is None
    assert pool.used == 0


# -- the engine's host cache ---------------------------------------------------------------------
def _async_save(state: dict, path: Path, engine) -> DataStatesWriter:
    writer = DataStatesWriter(engine=engine)
    dcp.async_save(state, checkpoint_id=path, storage_writer=writer,
                   no_dist=True).upload_completion.result(timeout=60)
    return writer


def _tensor_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def test_engine_auto_size_grows_with_the_state(tmp_path: Path, make_engine) -> None:
    engine = make_engine(io_backend="threads")  # host_cache_size="auto"
    assert engine.cache_bytes() == 0  # nothing is mapped before a save needs it
    small = {"a": rand_tensor((100_000,), torch.float32, seed=1), "n": 3}
    large = {"a": rand_tensor((3_000_000,), torch.float32, seed=2),
             "b": rand_tensor((7,), torch.int64, seed=3)}
    medium = {"a": rand_tensor((1_000_000,), torch.float32, seed=4)}
    sizes = []
    for k, state in enumerate((small, large, medium)):
        expected = clone_state(state)
        writer = _async_save(state, tmp_path / f"ckpt{k}", engine)
        assert engine.live_leases() == 0, "a save kept host cache memory after it ended"
        assert writer.last_stats().overflow_bytes == 0  # the whole state fit in the cache
        snapshot = engine.cache_bytes() - engine.arenas.bounce.nbytes
        assert snapshot >= _tensor_bytes(state)
        sizes.append(snapshot)
        assert_state_equal(load_into(expected, tmp_path / f"ckpt{k}"), expected)
    assert sizes[0] < _tensor_bytes(large) <= sizes[1]  # grown for the larger state
    assert sizes[1] < 2 * _tensor_bytes(large)  # sized from it (the old arena was freed)
    assert sizes[2] == sizes[1]  # a smaller state reuses the cache: no shrinking, no remap
    assert engine.arenas.bounce.nbytes == 128 * MiB
    engine.close()
    assert engine.cache_bytes() == 0


@pytest.mark.parametrize(("size", "bounce"), [("1MiB", 256 * KiB), (64 * KiB, 16 * KiB)])
def test_engine_explicit_size(tmp_path: Path, make_engine, size, bounce: int) -> None:
    engine = make_engine(host_cache_size=size, io_backend="threads")
    total = parse_size(size)
    state = {"big": rand_tensor((3 * MiB // 4,), torch.float32, seed=5),  # 3 MiB > the cache
             "small": rand_tensor((100,), torch.int16, seed=6)}
    expected = clone_state(state)
    for k in range(2):
        writer = _async_save(state, tmp_path / f"ckpt{k}", engine)
        assert engine.live_leases() == 0
        assert engine.cache_bytes() == total  # fixed: never grows
        assert engine.arenas.bounce.nbytes == bounce
        stats = writer.last_stats()
        assert stats.overflow_bytes > 0  # the rest was staged in pageable memory
        assert stats.staged_bytes + stats.overflow_bytes == _tensor_bytes(state)
        assert_state_equal(load_into(expected, tmp_path / f"ckpt{k}"), expected)


def test_engine_reserve_backpressure(make_engine) -> None:
    engine = make_engine(host_cache_size="1MiB", io_backend="threads")
    hog = engine.reserve(1 << 40)  # larger than the cache: admitted, with all of it
    assert hog is not None and hog.nbytes == hog.pool.capacity == 768 * KiB
    assert hog.addr % PAGE == 0
    assert engine.reserve(PAGE, wait=False) is None  # taken: no waiting
    assert engine.reserve(0) is None
    got: list[Lease] = []
    waiter = threading.Thread(target=lambda: got.append(engine.reserve(10 * PAGE)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not got, "reserve should wait while the cache is full"
    assert engine.live_leases() == 1
    threading.Thread(target=hog.release).start()
    waiter.join(10)
    assert not waiter.is_alive()
    (lease,) = got
    assert lease.nbytes == 10 * PAGE and engine.live_leases() == 1
    lease.release()
    assert engine.live_leases() == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_direct_io_save_under_file_system_sharing_strategy(
    tmp_path: Path, make_engine, sharing_strategy, mode: str
) -> None:
    """Host cache memory stays 4 KiB aligned (O_DIRECT needs it) whatever torch's sharing
    strategy; ``file_system`` is the one some launchers set."""
    sharing_strategy("file_system")
    engine = make_engine(host_cache_size="4MiB", io_backend="threads")
    state = {"big": rand_tensor((LARGE_ITEM_BYTES + 333,), torch.uint8, seed=7),
             "w": rand_tensor((300, 257), torch.float32, seed=8),
             "b": rand_tensor((5,), torch.bfloat16, seed=9), "step": 4}
    expected = clone_state(state)
    writer = DataStatesWriter(engine=engine, direct_io=True)
    if mode == "sync":
        dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer,
                   no_dist=True).upload_completion.result(timeout=60)
    else:
        dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer,
                       no_dist=True).upload_completion.result(timeout=60)
    assert writer.last_stats().direct_io is True
    assert engine.live_leases() == 0
    assert_state_equal(load_into(expected, tmp_path, io_backend="threads"), expected)


# -- an arena over a file ----------------------------------------------------------------------


def test_an_arena_over_a_file_shorter_than_it_is_refused_naming_the_file(
        tmp_path: Path) -> None:
    """Pages past a file's end fault with SIGBUS when touched (a copy into the arena would
    kill the process): the arena refuses such a file when it is made."""
    path = tmp_path / "short"
    path.write_bytes(b"x" * ALIGN)
    done = run_script(f"""
        import os
        from dcp_datastates._memory.host_cache import Arena
        fd = os.open({str(path)!r}, os.O_RDWR)
        try:
            arena = Arena(1 << 20, {str(path)!r}, fd=fd)
        except ValueError as exc:
            print("refused:", exc)
        else:
            arena.tensor[-1] = 1
            print("touched")
    """)
    assert done.returncode == 0, f"the process died (rc {done.returncode}): {done.stderr}"
    assert "refused:" in done.stdout and str(path) in done.stdout, done.stdout
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, ALIGN + 1)  # the page that holds the end is the file's: taken
        Arena(2 * ALIGN, "a file that ends inside its last page", fd=fd).free()
    finally:
        os.close(fd)


def test_an_arena_over_a_file_without_room_fails_at_once_and_gives_its_pages_back() -> None:
    """A memory-tier slot larger than its tmpfs's room fails when it is made (ENOSPC, naming
    it), not with SIGBUS at a copy; the pages allocated until then (pieces of it) go back to
    the tmpfs."""
    with mounted_tmpfs("40m", "dcp_arena_room_") as mnt:
        path = mnt / "slot"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 4 * MAP_PIECE)
            free = os.statvfs(mnt).f_bavail
            with pytest.raises(OSError, match="memory-tier slot") as raised:
                Arena(4 * MAP_PIECE, "memory-tier slot", fd=fd)
            assert raised.value.errno == errno.ENOSPC
            assert os.statvfs(mnt).f_bavail == free
            os.pwrite(fd, b"kept", MAP_PIECE + 8)  # a file that holds bytes (adopted) ...
            with pytest.raises(OSError, match="memory-tier slot"):
                Arena(4 * MAP_PIECE, "memory-tier slot", fd=fd)
            assert os.pread(fd, 4, MAP_PIECE + 8) == b"kept"  # ... keeps them
            os.ftruncate(fd, 0)
            os.ftruncate(fd, 2 * MiB)  # one that fits is made, its bytes zero
            arena = Arena(2 * MiB, "memory-tier slot", fd=fd)
            assert not arena.mapped().any()
            arena.free()
        finally:
            os.close(fd)


def test_engine_reserve_gives_up_when_its_caller_says(make_engine) -> None:
    """A wait for cache memory ends with None once ``give_up`` (the save order's judgement,
    injected by the save job) says so; without it, it waits on."""
    engine = make_engine(host_cache_size="1MiB", io_backend="threads")
    hog = engine.reserve(1 << 40)
    futile = threading.Event()
    got: list[Lease | None] = []
    waiter = threading.Thread(
        target=lambda: got.append(engine.reserve(10 * PAGE, give_up=futile.is_set)))
    waiter.start()
    try:
        waiter.join(0.3)
        assert waiter.is_alive() and not got
        futile.set()
        waiter.join(10)
        assert got == [None] and engine.live_leases() == 1
    finally:
        hog.release()


def test_a_snapshot_no_save_takes_stops_holding_the_cache_after_the_grace(
        tmp_path: Path, make_engine) -> None:
    """A snapshot staged with ``writer.stage()`` that no save takes fills the cache: a later
    save waits for the grace, then stages in pageable memory, and saves the right bytes."""
    engine = make_engine(host_cache_size="4MiB", io_backend="threads", io_workers=2)
    hog = DataStatesWriter(engine=engine)
    hog.stage({"w": rand_tensor((3 * MiB,), torch.uint8, seed=1)}).result(timeout=60)
    state = {"w": rand_tensor((MiB,), torch.uint8, seed=2)}
    writer = DataStatesWriter(engine=engine)
    dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer,
                   no_dist=True).upload_completion.result(timeout=60)
    assert writer.last_stats().overflow_bytes == MiB
    assert_state_equal(load_into(clone_state(state), tmp_path), state)
    hog.close()
