"""Save/load round trips through DataStatesWriter/Reader, compared bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    ALL_DTYPES,
    BACKENDS,
    MARKS,
    assert_bits_equal,
    assert_state_equal,
    blank_like,
    clone_state,
    data_files,
    load_into,
    raises_in_dcp,
    rand_tensor,
    require_backend,
    save,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from dcp_datastates import CheckpointCorruptError, DataStatesReader, DataStatesWriter, Engine
from dcp_datastates._format.checksums import BLOCK_BYTES
from dcp_datastates._format.data_file import LARGE_ITEM_BYTES

KiB, MiB = 1 << 10, 1 << 20

pytestmark = MARKS


def dtype_state() -> dict:
    """Every dtype in several shapes (0-d, empty, vector, matrix, > LARGE_ITEM_BYTES)."""
    state: dict = {}
    for k, dt in enumerate(ALL_DTYPES):
        name = str(dt).removeprefix("torch.")
        state[name] = {
            "scalar": rand_tensor((), dt, seed=10 * k),
            "vec": rand_tensor((37,), dt, seed=10 * k + 1),
            "mat": rand_tensor((5, 3), dt, seed=10 * k + 2),
            "empty": rand_tensor((0,), dt),
            "empty2d": rand_tensor((3, 0), dt),
        }
    state["float32"]["large"] = rand_tensor((LARGE_ITEM_BYTES // 4 + 123,), torch.float32, 99)
    state["bfloat16"]["large"] = rand_tensor((300, 129), torch.bfloat16, seed=98)
    state["complex128"]["large"] = rand_tensor((4097 + 5,), torch.complex128, seed=97)
    return state


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("direct_io", [True, False])
def test_every_dtype_round_trips_bit_exact(
    tmp_path: Path, make_writer, io_backend: str, direct_io: bool, mode: str
) -> None:
    state = dtype_state()
    expected = clone_state(state)
    writer = make_writer(io_backend=io_backend, direct_io=direct_io)
    if mode == "sync":
        save(state, tmp_path, writer)
    else:  # staged through the host cache first
        dcp.async_save(
            state, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True
        ).upload_completion.result(timeout=60)
    loaded = load_into(expected, tmp_path, io_backend=io_backend)
    assert_state_equal(loaded, expected)
    assert len(data_files(tmp_path)) == 1


def test_non_contiguous_and_view_tensors(tmp_path: Path, make_writer, io_backend: str) -> None:
    base = rand_tensor((64, 48), torch.float32, seed=1)
    huge = rand_tensor((1 << 18,), torch.float64, seed=2)  # 2 MiB storage
    state = {
        "transposed": base.t(),
        "strided": base[::3, 1::5],
        "offset_slice": base[10:20],
        "narrow_col": base.narrow(1, 7, 9),
        "expanded": torch.arange(6, dtype=torch.int16).expand(4, 6),
        "channels_last": rand_tensor((2, 3, 4, 5), torch.float16, 3).to(
            memory_format=torch.channels_last
        ),
        "small_view_of_huge": huge[1000:1003],
        "base": base,  # shares storage with the views above
        "nested": {"t": base.t()[2:5, ::2], "lst": [base[0], base[-1].flip(0)]},
    }
    for key in ("transposed", "strided", "narrow_col", "expanded", "channels_last"):
        assert not state[key].is_contiguous(), key
    expected = clone_state(state)
    save(state, tmp_path, make_writer(io_backend=io_backend))
    loaded = load_into(expected, tmp_path, io_backend=io_backend)
    assert_state_equal(loaded, expected)
    # Only the bytes of each view are written, not its whole storage (2 MiB for `huge`).
    (file,) = data_files(tmp_path)
    assert file.stat().st_size < 256 * KiB


def _bit_views(device: str) -> dict:
    """Conjugate and negative views, small (one memmove) and large, one of them sharing a
    storage with a plain tensor of the state."""
    c = rand_tensor((5, 3), torch.complex64, seed=7).to(device)
    big = rand_tensor((LARGE_ITEM_BYTES // 8 + 5,), torch.complex64, seed=8).to(device)
    r = rand_tensor((37,), torch.float32, seed=9).to(device)
    other = rand_tensor((4,), torch.complex128, seed=10).to(device)
    return {"conj": c.conj(), "conj_large": big.conj(), "neg": torch._neg_view(r),
            "neg_large": torch._neg_view(big.real.contiguous()), "plain": c,
            "neg_conj": torch._neg_view(other).conj()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_conjugate_and_negative_views_round_trip_as_dcp_does(tmp_path: Path, make_writer,
                                                               mode: str, device: str) -> None:
    """A view whose conjugate or negative bit is set is saved by its values, as DCP's
    FileSystemWriter saves it: both load the same values, with no bit set."""
    state = _bit_views(device)
    assert all(t.is_conj() or t.is_neg() for k, t in state.items() if k != "plain")
    ours, theirs = tmp_path / "datastates", tmp_path / "filesystem"
    writer = make_writer()
    if mode == "sync":
        save(state, ours, writer)
    else:
        dcp.async_save(state, checkpoint_id=ours, storage_writer=writer,
                       no_dist=True).upload_completion.result(timeout=60)
    dcp.save(state, storage_writer=FileSystemWriter(theirs), no_dist=True)
    template = {k: t.resolve_conj().resolve_neg() for k, t in state.items()}
    from_ours = load_into(template, ours)
    from_theirs = blank_like(template)
    dcp.load(from_theirs, storage_reader=FileSystemReader(theirs), no_dist=True)
    for k, t in template.items():
        assert_bits_equal(from_theirs[k], t.cpu(), k)
        assert_bits_equal(from_ours[k], from_theirs[k], k)
        assert (from_ours[k].is_conj(), from_ours[k].is_neg()) == (
            from_theirs[k].is_conj(), from_theirs[k].is_neg()), k


def test_python_objects_round_trip(tmp_path: Path, make_writer) -> None:
    state = {
        "step": 12345,
        "lr": 3.5e-4,
        "name": "run-ü-⚡",
        "flags": [True, False, None],
        "shape": (3, 4),
        "blob": b"\x00\xff raw bytes",
        "cfg": {"depth": 12, "heads": [4, 8], "act": "gelu", "eps": 1e-6},
        "mixed": [7, rand_tensor((4,), torch.int64, 5), {"k": "v", "t": torch.ones(2, 2)}],
        "big_int": 2**70,
    }
    expected = clone_state(state)
    save(state, tmp_path, make_writer())
    assert_state_equal(load_into(expected, tmp_path), expected)


def test_state_larger_than_host_cache_sync(tmp_path: Path, make_writer, io_backend: str) -> None:
    state = {
        "large": rand_tensor((3 * MiB // 4 + 17,), torch.float32, seed=4),  # > 1 MiB cache
        "large2": rand_tensor((1000, 700), torch.bfloat16, seed=5),
        "small": rand_tensor((9,), torch.int8, seed=6),
    }
    expected = clone_state(state)
    writer = make_writer(host_cache_size="1MiB", io_backend=io_backend)
    save(state, tmp_path, writer)
    assert writer.last_stats().bytes_written >= 3 * MiB + 1000 * 700 * 2
    assert_state_equal(load_into(expected, tmp_path, io_backend=io_backend), expected)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_minimum_host_cache_one_io_worker(
    tmp_path: Path, make_writer, io_backend: str, mode: str
) -> None:
    """16 KiB cache (4 KiB bounce pool, 4 KiB flush extents) and a single flush thread."""
    state = {
        "a": rand_tensor((300_000,), torch.float32, seed=71),
        "b": rand_tensor((5000,), torch.float16, seed=72),
        "c": rand_tensor((3,), torch.int64, seed=73),
    }
    expected = clone_state(state)
    writer = make_writer(host_cache_size=16 * KiB, io_backend=io_backend, io_workers=1)
    if mode == "sync":
        save(state, tmp_path, writer)
    else:
        dcp.async_save(
            state, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True
        ).upload_completion.result(timeout=60)
    loaded = load_into(expected, tmp_path, io_backend=io_backend, io_workers=1)
    assert_state_equal(loaded, expected)


def test_paths_given_to_constructors(tmp_path: Path, make_writer) -> None:
    """No checkpoint_id: the writer's and the reader's own path are used."""
    state = {"a": rand_tensor((10, 10), torch.float64, seed=74), "n": 5}
    expected = clone_state(state)
    dcp.save(state, storage_writer=make_writer(tmp_path / "c"), no_dist=True)
    out = blank_like(expected)
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c"), no_dist=True)
    assert_state_equal(out, expected)
    assert DataStatesReader.validate_checkpoint_id(tmp_path / "c")
    assert not DataStatesReader.validate_checkpoint_id(tmp_path)


def _train_adamw(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    for _ in range(3):
        loss = model(torch.randn(5, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def test_model_and_adamw_state_round_trip(tmp_path: Path, make_writer, io_backend: str) -> None:
    model, opt = _train_adamw(seed=0)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = clone_state(state)
    save(state, tmp_path, make_writer(io_backend=io_backend))

    fresh_model, fresh_opt = _train_adamw(seed=1)  # different weights and moments
    dest = {"model": fresh_model.state_dict(), "optim": blank_like(expected["optim"])}
    dcp.load(dest, checkpoint_id=tmp_path, storage_reader=DataStatesReader(), no_dist=True)
    fresh_model.load_state_dict(dest["model"])
    fresh_opt.load_state_dict(dest["optim"])

    assert_state_equal(fresh_model.state_dict(), expected["model"])
    got = fresh_opt.state_dict()
    assert got["param_groups"] == expected["optim"]["param_groups"]
    assert got["state"].keys() == expected["optim"]["state"].keys()
    for idx, per_param in expected["optim"]["state"].items():
        assert per_param.keys() == got["state"][idx].keys()
        for key, value in per_param.items():
            assert_bits_equal(got["state"][idx][key], value, f"state[{idx}][{key}]")


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("read_backend", BACKENDS)
@pytest.mark.parametrize("write_backend", BACKENDS)
def test_load_with_either_backend_and_verify_flag(
    tmp_path: Path, make_writer, write_backend: str, read_backend: str, verify: bool
) -> None:
    require_backend(write_backend)
    require_backend(read_backend)
    state = {
        "w": rand_tensor((256, 130), torch.float32, seed=7),
        "b": rand_tensor((130,), torch.bfloat16, seed=8),
        "meta": {"epoch": 3},
    }
    expected = clone_state(state)
    save(state, tmp_path, make_writer(io_backend=write_backend))
    loaded = load_into(expected, tmp_path, io_backend=read_backend, verify_checksums=verify)
    assert_state_equal(loaded, expected)


def _identity_state() -> dict:
    return {
        "large_unaligned": rand_tensor((LARGE_ITEM_BYTES + 333,), torch.uint8, seed=11),
        "large_aligned": rand_tensor((64, 1024), torch.float32, seed=12),
        "large_odd": rand_tensor((17, 4099), torch.float16, seed=13),
        "small_f64": rand_tensor((3,), torch.float64, seed=14),
        "small_i8": rand_tensor((5,), torch.int8, seed=15),
        "scalar": rand_tensor((), torch.int32, seed=16),
        "obj": {"k": [1, 2, 3]},
    }


def test_data_files_byte_identical_across_backends_direct_io_and_async(
    tmp_path: Path, make_writer
) -> None:
    """threads/uring x O_DIRECT on/off x sync/async write the very same bytes."""
    files = {}
    for backend in BACKENDS:
        try:
            require_backend(backend)
        except pytest.skip.Exception:
            continue
        for direct in (True, False):
            for mode in ("sync", "async"):
                directory = tmp_path / f"{backend}-{direct}-{mode}"
                writer = make_writer(io_backend=backend, direct_io=direct, host_cache_size="8MiB")
                state = _identity_state()
                if mode == "sync":
                    save(state, directory, writer)
                else:
                    dcp.async_save(
                        state, checkpoint_id=directory, storage_writer=writer, no_dist=True
                    ).upload_completion.result(timeout=60)
                assert writer.last_stats().direct_io is direct
                (file,) = data_files(directory)
                files[directory.name] = file.read_bytes()
    reference_name, reference = next(iter(files.items()))
    for name, content in files.items():
        assert len(content) == len(reference), (name, reference_name)
        assert content == reference, f"{name} differs from {reference_name}"


def test_same_values_as_dcp_filesystem_writer(tmp_path: Path, make_writer) -> None:
    model, opt = _train_adamw(seed=3)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "dtypes": {str(dt): rand_tensor((4, 3), dt, seed=i) for i, dt in enumerate(ALL_DTYPES)},
        "extra": {"step": 7, "tags": ["a", "b"]},
    }
    expected = clone_state(state)
    ours, theirs = tmp_path / "datastates", tmp_path / "filesystem"
    save(state, ours, make_writer())
    dcp.save(state, storage_writer=FileSystemWriter(theirs), no_dist=True)

    from_ours = load_into(expected, ours)
    from_theirs = blank_like(expected)
    dcp.load(from_theirs, storage_reader=FileSystemReader(theirs), no_dist=True)
    assert_state_equal(from_theirs, expected)
    assert_state_equal(from_ours, from_theirs)


def test_load_into_non_contiguous_and_offset_destinations(
    tmp_path: Path, make_writer, make_engine, io_backend: str
) -> None:
    src = rand_tensor((7, 5), torch.float64, seed=21)
    src2 = rand_tensor((7, 5), torch.int32, seed=22)
    save({"m": src, "n": src2}, tmp_path, make_writer(io_backend=io_backend))

    big = torch.full((5, 7), -1.0, dtype=torch.float64)  # destination big.t() is (7, 5)
    guard = torch.full((100,), -7, dtype=torch.int32)  # destination is a slice at offset 10
    dest = {"m": big.t(), "n": guard[10:45].view(7, 5)}
    assert not dest["m"].is_contiguous()
    dcp.load(
        dest,
        checkpoint_id=tmp_path,
        storage_reader=DataStatesReader(engine=make_engine(io_backend=io_backend)),
        no_dist=True,
    )
    assert_bits_equal(big.t(), src)
    assert_bits_equal(guard[10:45].view(7, 5), src2)
    assert (guard[:10] == -7).all() and (guard[45:] == -7).all()


class _SlicePlanner(DefaultLoadPlanner):
    """Reads one hyper-rectangle of a stored tensor into a tensor of that shape (resharding)."""

    def __init__(self, fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> None:
        super().__init__()
        self.fqn, self.offsets, self.lengths = fqn, offsets, lengths

    def create_local_plan(self) -> LoadPlan:
        (chunk,) = self.metadata.state_dict_metadata[self.fqn].chunks
        zeros = (0,) * len(self.lengths)
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(self.fqn, zeros),
            dest_offsets=torch.Size(zeros),
            storage_index=MetadataIndex(self.fqn, tuple(chunk.offsets)),
            storage_offsets=torch.Size(self.offsets),
            lengths=torch.Size(self.lengths),
        )
        return LoadPlan([item])


def _read_slice(path: Path, offsets, lengths, dtype, engine: Engine, verify=True):
    dest = {"w": torch.full(lengths, 0x55, dtype=dtype)}
    dcp.load(
        dest,
        checkpoint_id=path,
        storage_reader=DataStatesReader(engine=engine, verify_checksums=verify),
        planner=_SlicePlanner("w", offsets, lengths),
        no_dist=True,
    )
    return dest["w"]


# A tensor spanning 4 checksum blocks (of the real 16 MiB: no module constant is patched):
# 128-byte rows, ROWS rows per block, 64 MiB in all. Saved once per backend for the module.
COLS = 32
ROWS = BLOCK_BYTES // (COLS * 4)
NBLOCKS = 4


@pytest.fixture(scope="module", params=BACKENDS)
def multi_block(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint dir, source tensor, engine of that backend) of a multi-block checkpoint."""
    backend = require_backend(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("DCP_DATASTATES_IO", raising=False)
        engine = Engine(host_cache_size="4MiB", io_backend=backend, io_workers=4)
    try:
        src = rand_tensor((NBLOCKS * ROWS, COLS), torch.float32, seed=31)
        path = tmp_path_factory.mktemp(f"multi_block_{backend}")
        save({"w": src}, path, DataStatesWriter(engine=engine))
        loc = next(iter(DataStatesReader(path).read_metadata().storage_data.values()))
        assert loc.block == BLOCK_BYTES and len(loc.checksums) == NBLOCKS
        yield path, src, engine
        assert engine.live_leases() == 0
    finally:
        engine.close()


R = ROWS
# Slices whose first byte is on a checksum-block boundary.
ALIGNED_SLICES = [
    ((0, 0), (NBLOCKS * R, COLS)),  # everything
    ((0, 0), (R + R // 3, COLS)),  # whole rows from the start, trailing edge block read back
    ((R, 0), (2 * R, COLS)),  # whole rows, block-aligned start: direct read
    (((NBLOCKS - 1) * R, 0), (R, COLS)),  # the last block exactly
    ((R, 3), (R + 8, 17)),  # column slice: copy path
]
# Slices starting inside a block: the reader must read the block's leading edge to verify it.
UNALIGNED_SLICES = [
    ((R + R // 4, 0), (R, COLS)),  # whole rows (direct path), 4 MiB leading edge
    ((R + 4, 2), (10, 5)),  # column slice (copy path), 512-byte leading edge
    ((R + 100, COLS - 1), ((NBLOCKS - 1) * R - 100, 1)),  # last column to the end
]


@pytest.mark.parametrize(("offsets", "lengths"), ALIGNED_SLICES)
def test_partial_reads_block_aligned(multi_block, offsets, lengths) -> None:
    """Row/column slices of a tensor spanning 4 checksum blocks come back exactly."""
    path, src, engine = multi_block
    got = _read_slice(path, offsets, lengths, torch.float32, engine)
    (r, c), (nr, nc) = offsets, lengths
    assert_bits_equal(got, src[r : r + nr, c : c + nc])


@pytest.mark.parametrize(("offsets", "lengths"), UNALIGNED_SLICES)
def test_partial_reads_starting_inside_a_block(multi_block, offsets, lengths) -> None:
    """Regression: the leading-edge buffer read for verification must outlive the check
    (it was freed before verify_span hashed it: spurious checksum mismatches)."""
    path, src, engine = multi_block
    got = _read_slice(path, offsets, lengths, torch.float32, engine)
    (r, c), (nr, nc) = offsets, lengths
    assert_bits_equal(got, src[r : r + nr, c : c + nc])


@pytest.mark.parametrize("verify", [False, True])
def test_partial_read_default_block_size(
    tmp_path: Path, make_writer, io_backend: str, verify: bool
) -> None:
    """Resharding-style read of rows 8..15 of an 8 KiB tensor (one checksum block)."""
    src = rand_tensor((64, 32), torch.float32, seed=33)
    writer = make_writer(io_backend=io_backend)
    save({"w": src}, tmp_path, writer)
    got = _read_slice(tmp_path, (8, 0), (8, 32), torch.float32, writer.engine, verify=verify)
    assert_bits_equal(got, src[8:16])


def test_partial_read_checks_only_the_blocks_it_touches(tmp_path: Path, multi_block) -> None:
    original, src, engine = multi_block
    path = tmp_path / "ckpt"
    shutil.copytree(original, path)
    loc = next(iter(DataStatesReader(path).read_metadata().storage_data.values()))
    (file,) = data_files(path)
    last = NBLOCKS - 1
    flip_at = last * BLOCK_BYTES + 5  # item byte inside the last block
    with open(file, "r+b") as f:
        f.seek(loc.offset + flip_at)
        byte = f.read(1)[0]
        f.seek(loc.offset + flip_at)
        f.write(bytes([byte ^ 0x10]))

    # Rows before the last block are unaffected.
    n = R + R // 3
    assert_bits_equal(_read_slice(path, (0, 0), (n, COLS), torch.float32, engine), src[:n])
    with raises_in_dcp(
        CheckpointCorruptError,
        rf"file {file.name}, item 'w': checksum mismatch in item bytes "
        rf"{last * BLOCK_BYTES}\.\.{NBLOCKS * BLOCK_BYTES}",
    ):
        _read_slice(path, (last * R, 4), (10, 8), torch.float32, engine)
    # Without verification the flipped byte is returned as stored.
    got = _read_slice(path, (last * R, 0), (R, COLS), torch.float32, engine, verify=False)
    expected = src[last * R :].clone()
    expected.reshape(-1).view(torch.uint8)[flip_at - last * R * COLS * 4] ^= 0x10
    assert_bits_equal(got, expected)
    assert not torch.equal(got, src[last * R :])
