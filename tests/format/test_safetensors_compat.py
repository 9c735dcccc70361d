"""The data files are plain safetensors files: other readers open them and see the saved values."""

from __future__ import annotations

import io
import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    ALL_DTYPES,
    MARKS,
    RAW_DTYPES,
    as_bytes,
    assert_bits_equal,
    assert_state_equal,
    clone_state,
    data_files,
    load_into,
    rand_tensor,
    save,
)
from safetensors import safe_open
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from dcp_datastates._format.data_file import LARGE_ITEM_BYTES, PAD_PREFIX

KiB = 1 << 10

pytestmark = MARKS


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8 : 8 + n])


def _rich_state() -> dict:
    state: dict = {
        "dt": {str(dt).removeprefix("torch."): rand_tensor((3, 5), dt, seed=i)
               for i, dt in enumerate(ALL_DTYPES)},
        "scalar": rand_tensor((), torch.float64, seed=50),
        "empty": torch.empty(0, 4),
        "large": rand_tensor((LARGE_ITEM_BYTES // 2 + 7,), torch.bfloat16, seed=51),
        "large2": rand_tensor((33, 1000), torch.int32, seed=52),
        "obj": {"step": 9, "name": "abc", "lst": [1, 2.5]},
        "view": rand_tensor((40, 30), torch.float32, seed=53).t()[3:9],
    }
    return state


@pytest.mark.parametrize("direct_io", [True, False])
def test_safe_open_reads_every_saved_item(
    tmp_path: Path, make_writer, io_backend: str, direct_io: bool
) -> None:
    state = _rich_state()
    flat, _ = flatten_state_dict(clone_state(state))
    save(state, tmp_path, make_writer(io_backend=io_backend, direct_io=direct_io))
    (file,) = data_files(tmp_path)

    seen = set()
    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "dcp_datastates" and meta["format_version"] == "1"
        raw_items = json.loads(meta.get("raw_items", "{}"))
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            tensor = f.get_tensor(key)
            if key.startswith(PAD_PREFIX):
                assert tensor.dtype == torch.uint8 and not tensor.any(), key
                continue
            seen.add(key)
            expected = flat[key]
            if key in raw_items:
                assert tensor.dtype == torch.uint8 and tensor.dim() == 1, key
                if raw_items[key] == "pickle":  # a DCP bytes item: torch.save'd object
                    obj = torch.load(io.BytesIO(tensor.numpy().tobytes()), weights_only=False)
                    assert_state_equal(obj, expected, key)
                else:
                    assert raw_items[key] == str(expected.dtype), key
                    assert torch.equal(tensor, as_bytes(expected)), key
            else:
                assert_bits_equal(tensor, expected, key)
    assert seen == set(flat)
    assert {json.loads(meta["raw_items"])[f"dt.{str(dt)[6:]}"] for dt in RAW_DTYPES} == {
        str(dt) for dt in RAW_DTYPES
    }


def test_layout_alignment_and_tiling(tmp_path: Path, make_writer) -> None:
    save(_rich_state(), tmp_path, make_writer())
    (file,) = data_files(tmp_path)
    data_start, header = _header(file)
    assert data_start % 4096 == 0
    raw = file.read_bytes()
    text = raw[8:data_start].rstrip(b" ")  # the JSON, padded with spaces only
    assert text.endswith(b"}") and json.loads(text) == header
    entries = sorted(
        (v["data_offsets"], k, v) for k, v in header.items() if k != "__metadata__"
    )
    cursor = 0
    for (begin, end), key, entry in entries:
        assert begin == cursor, f"gap or overlap before {key}"
        cursor = end
        nbytes = end - begin
        if nbytes >= LARGE_ITEM_BYTES and not key.startswith(PAD_PREFIX):
            assert (data_start + begin) % 4096 == 0, key
        elif not key.startswith(PAD_PREFIX):
            itemsize = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4,
                        "F16": 2, "BF16": 2, "I16": 2, "U16": 2}.get(entry["dtype"], 1)
            assert begin % itemsize == 0, f"{key} misaligned for {entry['dtype']}"
    assert data_start + cursor == len(raw)
    large = [k for (b, e), k, _ in entries if e - b >= LARGE_ITEM_BYTES and PAD_PREFIX not in k]
    assert set(large) == {"large", "large2"}


def _fill_cache_with_ones_then_save(tmp_path: Path, make_writer, mode: str, direct: bool):
    """Save all-0xFF tensors, then a tensor whose size is not a multiple of 4 KiB."""
    writer = make_writer(host_cache_size="1MiB", direct_io=direct)

    def run(state: dict, directory: Path) -> None:
        if mode == "sync":
            save(state, directory, writer)
        else:
            dcp.async_save(
                state, checkpoint_id=directory, storage_writer=writer, no_dist=True
            ).upload_completion.result(timeout=60)

    garbage = {f"ff{i}": torch.full((180 * KiB,), 0xFF, dtype=torch.uint8) for i in range(4)}
    run(garbage, tmp_path / "garbage")
    # Make the staleness certain: every byte of the (now idle) cache is 0xFF.
    engine = writer.engine
    assert engine.live_leases() == 0
    # (the cache has a fixed size: a request larger than it gets all of it)
    bounce = engine.arenas.bounce
    whole = [engine.reserve(1 << 40), bounce.pool.try_allocate(bounce.nbytes)]
    try:
        for lease in whole:
            assert lease is not None and lease.offset == 0
            assert lease.nbytes == lease.pool.capacity
            lease.as_tensor().fill_(0xFF)
    finally:
        for lease in whole:
            if lease is not None:
                lease.release()
    assert engine.live_leases() == 0

    state = {
        "odd": rand_tensor((LARGE_ITEM_BYTES + 100,), torch.uint8, seed=60),
        "tail": rand_tensor((3,), torch.int16, seed=61),
    }
    run(state, tmp_path / "ckpt")
    return state, tmp_path / "ckpt"


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_padding_is_zero_not_stale_cache_bytes(
    tmp_path: Path, make_writer, mode: str, direct: bool
) -> None:
    state, directory = _fill_cache_with_ones_then_save(tmp_path, make_writer, mode, direct)
    (file,) = data_files(directory)
    data_start, header = _header(file)
    raw = file.read_bytes()
    pads = [v for k, v in header.items() if k.startswith(PAD_PREFIX)]
    assert len(pads) == 1
    begin, end = pads[0]["data_offsets"]
    assert end - begin == 4096 - 100
    assert raw[data_start + begin : data_start + end] == bytes(end - begin)
    with safe_open(str(file), "pt") as f:
        assert_bits_equal(f.get_tensor("odd"), state["odd"])
        assert_bits_equal(f.get_tensor("tail"), state["tail"])
    assert_state_equal(load_into(state, directory), state)


@pytest.mark.parametrize("where", ["direct_io_false", "tmpfs_default"])
def test_buffered_file_ending_in_padding_is_complete(
    tmp_path: Path, make_writer, io_backend: str, where: str
) -> None:
    """Without O_DIRECT the file must still reach the size its header describes."""
    state = {"big": rand_tensor((LARGE_ITEM_BYTES + 1,), torch.uint8, seed=70)}
    reference = tmp_path / "reference"
    save(state, reference, make_writer(direct_io=True, io_backend=io_backend))
    if where == "direct_io_false":
        directory, writer = tmp_path / "ckpt", make_writer(direct_io=False, io_backend=io_backend)
    else:  # direct_io=None (the default) writes buffered on memory file systems
        if not Path("/dev/shm").is_dir():
            pytest.skip("no /dev/shm")
        directory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="dcp_datastates_test_"))
        writer = make_writer(io_backend=io_backend)
    try:
        save(state, directory, writer)
        if writer.last_stats().direct_io:
            pytest.skip("this build writes O_DIRECT here")
        assert_state_equal(load_into(state, directory), state)  # our reader copes either way
        (file,) = data_files(directory)
        (ref_file,) = data_files(reference)
        with safe_open(str(file), "pt") as f:
            assert_bits_equal(f.get_tensor("big"), state["big"])
        assert file.read_bytes() == ref_file.read_bytes()
    finally:
        if where == "tmpfs_default":
            shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("key", ["__metadata__", f"{PAD_PREFIX}1"])
def test_reserved_entry_names_do_not_break_the_file(
    tmp_path: Path, make_writer, key: str
) -> None:
    """State keys equal to safetensors' or our own reserved header keys still give a valid file."""
    state = {
        "big": rand_tensor((LARGE_ITEM_BYTES + 8,), torch.uint8, seed=80),
        key: rand_tensor((5,), torch.int32, seed=81),
    }
    save(state, tmp_path, make_writer())
    assert_state_equal(load_into(state, tmp_path), state)
    (file,) = data_files(tmp_path)
    with safe_open(str(file), "pt") as f:
        assert_bits_equal(f.get_tensor("big"), state["big"])
        names = [k for k in f.keys() if k != "big"]  # noqa: SIM118
        pads = [k for k in names if k.startswith(PAD_PREFIX)]
        assert len(pads) == 1 and not f.get_tensor(pads[0]).any()
        (other,) = [k for k in names if k not in pads]
        assert other != "__metadata__"
        assert_bits_equal(f.get_tensor(other), state[key])
