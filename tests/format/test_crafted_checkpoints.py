"""Crafted checkpoints: headers and .metadata made to attack a reader are refused clearly,
never run or escape."""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import io
import itertools
import json
import os
import pickle
import re
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    assert_state_equal,
    clone_state,
    data_files,
    load_into,
    raises_in_dcp,
    rand_tensor,
    save,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_datastates import CheckpointCorruptError, DataStatesReader
from dcp_datastates import _cli as cli
from dcp_datastates._format.align import ALIGN
from dcp_datastates._format.data_file import (
    LARGE_ITEM_BYTES,
    MAX_HEADER_BYTES,
    PAD_PREFIX,
    ItemSpec,
    entry_key,
    plan_layout,
    read_header,
)
from dcp_datastates._format.directory import LOCK_NAME
from dcp_datastates._format.entries import tiling_problem
from dcp_datastates._format.metadata_file import read_metadata, write_metadata

pytestmark = MARKS

PATH = "/ckpt/__0_deadbeef.safetensors"


def _framed(body: bytes, extra: int = 0) -> bytes:
    """A data file's start: the 8-byte length, ``body``, then ``extra`` data bytes."""
    return struct.pack("<Q", len(body)) + body + b"\0" * extra


# -- the data file's header parser ---------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(head=st.binary(max_size=256), slack=st.integers(-16, 1 << 20))
def test_read_header_arbitrary_bytes_parse_or_corrupt(head: bytes, slack: int) -> None:
    file_size = max(len(head) + slack, 0)
    try:
        start, header = read_header(head, PATH, file_size)
    except CheckpointCorruptError as exc:
        assert PATH in str(exc)
        return
    assert isinstance(header, dict) and 8 <= start <= file_size


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12,
)
_entries = st.dictionaries(
    st.text(max_size=10),
    _json | st.fixed_dictionaries({"data_offsets": st.lists(_json, max_size=3)}),
    max_size=5,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=_entries, extra=st.integers(0, 64))
def test_read_header_json_shaped_input_parse_or_corrupt(header: dict, extra: int) -> None:
    """JSON objects of every shape: only well-formed entries inside the data may pass."""
    body = json.dumps(header, allow_nan=True).encode()
    content = _framed(body, extra)
    try:
        start, parsed = read_header(content, PATH, len(content))
    except CheckpointCorruptError as exc:
        assert PATH in str(exc)
        return
    assert start == 8 + len(body)
    for name, entry in parsed.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        assert type(a) is int and type(b) is int and 0 <= a <= b <= extra


_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64,
           torch.complex128, None]


@st.composite
def _specs(draw) -> list[ItemSpec]:
    names = draw(st.lists(st.text(min_size=1, max_size=12), unique=True, max_size=6))
    specs = []
    for name in names:
        dtype = draw(st.sampled_from(_DTYPES))
        size = 1 if dtype is None else torch.empty((), dtype=dtype).element_size()
        big = draw(st.booleans())
        n = draw(st.integers(0, 40)) + (LARGE_ITEM_BYTES // size if big else 0)
        specs.append(ItemSpec(name, dtype, (n,), n * size))
    return specs


@settings(max_examples=150, deadline=None)
@given(specs=_specs())
def test_plan_layout_headers_round_trip(specs: list[ItemSpec]) -> None:
    layout = plan_layout(specs)
    content = layout.header + b"\0" * (layout.file_size - len(layout.header))
    start, header = read_header(content, PATH, len(content))
    assert start == layout.data_start and start % ALIGN == 0
    assert header["__metadata__"]["format"] == "dcp_datastates"
    placed = {p.spec.name: p for p in layout.placements if p.spec is not None}
    assert placed.keys() == {s.name for s in specs}
    for spec in specs:
        entry = header[entry_key(spec.name)]
        p = placed[spec.name]
        assert entry["data_offsets"] == [p.begin, p.end]
        assert p.end - p.begin == spec.nbytes
        if spec.dtype is not None and spec.nbytes >= LARGE_ITEM_BYTES:
            assert (start + p.begin) % ALIGN == 0
    # Bytes items (sizes known only once serialized) come after every tensor, the first of
    # them starting on a block of its own, so they move no tensor.
    raw = [placed[s.name] for s in specs if s.dtype is None]
    tensors = [placed[s.name] for s in specs if s.dtype is not None]
    if raw:
        first = min(p.begin for p in raw)
        assert (start + first) % ALIGN == 0
        assert all(t.end <= first for t in tensors)
    pads = [k for k in header if k.startswith(PAD_PREFIX)]
    assert len(header) == 1 + len(specs) + len(pads)


@pytest.mark.parametrize(
    ("content", "file_size", "message"),
    [
        (struct.pack("<Q", 1 << 60) + b"{}", 1 << 20, r"header length 1152921504606846976"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1), 1 << 30, r"is impossible"),
        (_framed(b"{}"), 9, r"header length 2 is impossible for a file of 9"),
        (b"\x02\0\0", 3, r"too short"),
        (_framed(b'{"\xff\xfe":1}'), 100, r"not valid UTF-8 JSON"),
        (_framed(b"[" * 50_000), 1 << 20, r"not valid UTF-8 JSON"),  # nesting past the C stack
        (_framed(b'{"a":' + b"9" * 5000 + b"}"), 1 << 20, r"not valid UTF-8 JSON"),  # int limit
        (_framed(b"[1,2]"), 100, r"not a JSON object"),
        (_framed(b'{"a":{"data_offsets":[0,99]}}'), 40,
         r"truncated: item 'a' needs bytes 37\.\.136"),
        (_framed(b'{"a":{"data_offsets":[5,4]}}', 10), None, r"entry 'a'"),
        (_framed(b'{"a":{"data_offsets":[-1,4]}}', 10), None, r"entry 'a'"),
        (_framed(b'{"a":{"data_offsets":[0,1.0]}}', 10), None, r"entry 'a'"),
        (_framed(b'{"a":{"data_offsets":[false,true]}}', 10), None, r"entry 'a'"),
        (_framed(b'{"a":{"data_offsets":[0,1,2]}}', 10), None, r"entry 'a'"),
        (_framed(b'{"a":[0,1]}', 10), None, r"entry 'a'"),
    ],
)
def test_read_header_rejects(content: bytes, file_size: int | None, message: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=message) as info:
        read_header(content, PATH, len(content) if file_size is None else file_size)
    assert PATH in str(info.value)


def test_read_header_of_a_real_data_file_with_a_damaged_length(tmp_path: Path, make_writer):
    directory = tmp_path / "ckpt"
    save({"w": rand_tensor((1000,), torch.float32)}, directory, make_writer())
    (file,) = data_files(directory)
    content = bytearray(file.read_bytes())
    start, header = read_header(bytes(content), str(file), len(content))
    assert header["w"]["dtype"] == "F32"
    content[:8] = struct.pack("<Q", len(content))  # one past what the file can hold
    with pytest.raises(CheckpointCorruptError, match=re.escape(str(file))):
        read_header(bytes(content), str(file), len(content))


# -- crafted .metadata ---------------------------------------------------------------------------
def _state() -> dict:
    return {
        "w": rand_tensor((300, 257), torch.float32, seed=1),
        "blob": {"cfg": [1, "two", 3.0]},
    }


@pytest.fixture
def checkpoint(tmp_path: Path, make_writer) -> tuple[Path, dict]:
    directory = tmp_path / "ckpt"
    state = _state()
    expected = clone_state(state)
    save(state, directory, make_writer())
    return directory, expected


def _replace_location(directory: Path, fqn: str, **changes: object) -> None:
    metadata = read_metadata(directory)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)
    write_metadata(directory, metadata, "test")


#: Path lists of the ``_opened()`` blocks now running: the audit hook records into each.
_RECORDERS: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _RECORDERS and isinstance(args[0], (str, bytes, os.PathLike)):
        for paths in _RECORDERS:
            paths.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only inside _opened()


@contextlib.contextmanager
def _opened() -> Iterator[list[str]]:
    """Every path opened (``open``, ``os.open``, ... raise the ``open`` audit event) inside."""
    paths: list[str] = []
    _RECORDERS.append(paths)
    try:
        yield paths
    finally:
        _RECORDERS.remove(paths)


@pytest.mark.parametrize(
    "bad_file",
    ["../outside.safetensors", "/etc/passwd", "sub/../x.safetensors", "..", ".", "",
     "a\\..\\b", "x\0y", b"../outside.safetensors", None, 7],
)
def test_location_file_outside_the_directory(checkpoint, bad_file: object) -> None:
    directory, expected = checkpoint
    outside = directory.parent / "outside.safetensors"
    outside.write_bytes(data_files(directory)[0].read_bytes())  # a target that would "work"
    _replace_location(directory, "w", file=bad_file)
    with _opened() as paths, raises_in_dcp(
        CheckpointCorruptError, r"item 'w' has an invalid location"
    ):
        load_into(expected, directory)
    assert any(p.endswith(".metadata") for p in paths), "the audit hook saw no open"
    assert not any(os.path.basename(p) in ("outside.safetensors", "passwd") for p in paths)


def test_location_file_with_non_utf8_name(checkpoint) -> None:
    directory, expected = checkpoint
    name = os.fsdecode(b"\xff\xfe.safetensors")  # a surrogate-escaped, non-UTF-8 file name
    _replace_location(directory, "w", file=name)
    with raises_in_dcp(CheckpointCorruptError, r"data file .* is missing"):
        load_into(expected, directory)


def test_location_file_that_is_a_directory(checkpoint) -> None:
    directory, expected = checkpoint
    (directory / "sub").mkdir()
    _replace_location(directory, "w", file="sub")
    with raises_in_dcp(CheckpointCorruptError, r"data file sub is not a regular file.*item 'w'"):
        load_into(expected, directory)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"offset": -1}, r"item 'w' has an invalid location"),
        ({"length": -5}, r"item 'w' has an invalid location"),
        ({"block": 0}, r"item 'w' has an invalid location"),
        ({"block": -4096}, r"item 'w' has an invalid location"),
        ({"offset": "0"}, r"item 'w' has an invalid location"),
        ({"offset": 1.5}, r"item 'w' has an invalid location"),
        ({"length": None}, r"item 'w' has an invalid location"),
        ({"offset": True}, r"item 'w' has an invalid location"),
        ({"offset": 1 << 62}, r"item 'w' needs bytes 4611686018427387904\.\..* the file has"),
        ({"offset": 2**64 + 1}, r"item 'w' has an invalid location"),  # beyond 64 bits
        ({"length": 1 << 62}, r"item 'w' has 1 checksums where its 4611686018427387904 bytes"),
        ({"checksums": ()}, r"item 'w' has 0 checksums where its \d+ bytes .* need 1"),
        ({"checksums": None}, r"item 'w' has .*checksums"),
        ({"checksums": ("1",)}, r"item 'w' has 1 checksums"),
        ({"block": 4096}, r"item 'w' has 1 checksums where its 308400 bytes in blocks of 4096 "
                          r"need 76"),
    ],
)
def test_location_numbers_are_checked(checkpoint, changes: dict, message: str) -> None:
    directory, expected = checkpoint
    _replace_location(directory, "w", **changes)
    with raises_in_dcp(CheckpointCorruptError, message):
        load_into(expected, directory)


@pytest.mark.parametrize(
    "verify",
    [
        pytest.param(True, id="verify-small"),
        pytest.param(False, id="no_verify-small"),
    ],
)
def test_location_length_disagreeing_with_the_tensor(checkpoint, verify: bool) -> None:
    """``w`` (300 KiB) is read in a coalesced span of small items."""
    directory, expected = checkpoint
    loc = next(v for k, v in read_metadata(directory).storage_data.items() if k.fqn == "w")
    _replace_location(directory, "w", length=loc.length - 4)
    with raises_in_dcp(CheckpointCorruptError, r"item 'w'.*bytes stored for a torch.float32"):
        load_into(expected, directory, verify_checksums=verify)


@pytest.mark.parametrize("verify", [True, False])
def test_large_location_length_disagreeing_with_the_tensor(
    tmp_path: Path, make_writer, verify: bool
) -> None:
    """A tensor over 1 MiB is read on its own (not in a span): the same check applies."""
    directory = tmp_path / "ckpt"
    state = {"w": rand_tensor((600, 1000), torch.float32, seed=2)}
    save(state, directory, make_writer())
    loc = next(v for k, v in read_metadata(directory).storage_data.items() if k.fqn == "w")
    _replace_location(directory, "w", length=loc.length - 4)
    with raises_in_dcp(CheckpointCorruptError, r"item 'w'.*bytes stored for a torch.float32"):
        load_into(state, directory, verify_checksums=verify)


@pytest.mark.parametrize("verify", [True, False])
def test_location_shifted_offset_disagrees_with_the_header(checkpoint, verify: bool) -> None:
    """Caught before any read (checksums or not): the header places the item elsewhere."""
    directory, expected = checkpoint
    loc = next(v for k, v in read_metadata(directory).storage_data.items() if k.fqn == "w")
    _replace_location(directory, "w", offset=loc.offset - 4)
    with raises_in_dcp(CheckpointCorruptError,
                       r"item 'w': the data file's header does not match \.metadata: "
                       r"data_offsets \[0, 308400\] in the header, \[-4, 308396\] in \.metadata"):
        load_into(expected, directory, verify_checksums=verify)


# -- loading never runs code from the checkpoint -------------------------------------------------
class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Exec:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _torch_save(path: Path, obj: object) -> None:
    buf = io.BytesIO()  # torch.save refuses a path whose name starts with a dot
    torch.save(obj, buf)
    path.write_bytes(buf.getvalue())


@pytest.mark.parametrize("payload", [_System, _Exec])
@pytest.mark.parametrize("container", ["pickle", "torch.save"])
def test_malicious_metadata_is_never_run(
    checkpoint, tmp_path: Path, payload: type, container: str
) -> None:
    directory, expected = checkpoint
    marker = tmp_path / f"pwned-{payload.__name__}-{container.replace('.', '_')}"
    evil = payload(marker)
    if container == "pickle":
        (directory / ".metadata").write_bytes(pickle.dumps(evil, protocol=2))
    else:
        _torch_save(directory / ".metadata", {"metadata": evil})
    with raises_in_dcp(
        CheckpointCorruptError,
        rf"{re.escape(str(directory / '.metadata'))}: cannot read checkpoint metadata .*without "
        rf"running pickled code",
    ):
        load_into(expected, directory)
    with pytest.raises(CheckpointCorruptError):
        read_metadata(directory)
    assert not marker.exists(), "loading ran code from the checkpoint"


def test_metadata_that_is_not_metadata(checkpoint) -> None:
    directory, expected = checkpoint
    _torch_save(directory / ".metadata", {"storage_data": {}})
    with raises_in_dcp(CheckpointCorruptError, r"holds dict, not DCP Metadata"):
        load_into(expected, directory)


def test_storage_data_that_is_not_a_mapping(checkpoint) -> None:
    directory, expected = checkpoint
    metadata = read_metadata(directory)
    metadata.storage_data = [1, 2]
    write_metadata(directory, metadata, "test")
    with raises_in_dcp(CheckpointCorruptError, r"storage_data is a \w+, not a mapping"):
        load_into(expected, directory)


def test_metadata_from_a_newer_torch_loads(checkpoint) -> None:
    """torch 2.15 appended ``strides`` to what a ``TensorProperties`` pickles, which torch 2.14
    and older cannot unpickle: fields a newer torch appended are dropped, those this torch
    knows are kept."""
    directory, expected = checkpoint
    metadata = read_metadata(directory)

    def newer(props: TensorProperties) -> tuple:
        state = props.__getstate__()[:5] + ((1,), "a field of a torch still to come")
        return copyreg.__newobj__, (TensorProperties,), state

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = copyreg.dispatch_table | {TensorProperties: newer}
    pickler.dump(metadata)
    (directory / ".metadata").write_bytes(buf.getvalue())
    read = read_metadata(directory)
    props = [md.properties for md in read.state_dict_metadata.values()
             if hasattr(md, "properties")]
    assert props and all(type(p) is TensorProperties for p in props)
    assert all(getattr(p, "strides", (1,)) == (1,) for p in props)  # kept where known
    assert_state_equal(load_into(expected, directory), expected)


# -- hostile names in the state itself round-trip ------------------------------------------------
def test_hostile_state_names_round_trip(tmp_path: Path, make_writer) -> None:
    names = ["../../etc/passwd", "/abs", "__metadata__", f"{PAD_PREFIX}0", "a\\b", "nul\0x",
             "\u202eevil", "\U0001f600", "sp ace", ""]
    state = {n: rand_tensor((17,), torch.float32, seed=i) for i, n in enumerate(names)}
    state["big"] = rand_tensor((LARGE_ITEM_BYTES + 3,), torch.uint8, seed=99)
    expected = clone_state(state)
    directory = tmp_path / "ckpt"
    save(state, directory, make_writer())
    (file,) = data_files(directory)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [".metadata", LOCK_NAME, file.name]
    )
    assert len(list(tmp_path.iterdir())) == 1  # nothing written outside
    assert_state_equal(load_into(expected, directory), expected)
    content = file.read_bytes()
    read_header(content, str(file), len(content))


def test_location_file_that_is_a_fifo(checkpoint) -> None:
    """A FIFO under a data file's name is refused at once, not waited on."""
    directory, expected = checkpoint
    os.mkfifo(directory / "pipe")
    _replace_location(directory, "w", file="pipe")
    with raises_in_dcp(CheckpointCorruptError, r"data file pipe is not a regular file.*item 'w'"):
        load_into(expected, directory)


# -- chunks that do not tile their tensor --------------------------------------------------------
def test_half_committed_sharded_save_is_refused(tmp_path: Path, make_writer,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A ``.metadata`` whose stored chunks cover 8 of a tensor's 16 elements (a sharded save
    committed without one rank's chunk): ``verify`` fails it and a load refuses it, naming the
    checkpoint, the item and the elements no chunk holds; the target keeps its values."""
    directory = tmp_path / "ckpt"
    save({"a": torch.arange(8.0)}, directory, make_writer())
    metadata = read_metadata(directory)
    metadata.state_dict_metadata["a"].size = torch.Size([16])
    write_metadata(directory, metadata, "test")
    why = f"{directory}: item 'a': chunks cover 8 of its 16 elements; elements [8:16] are in no"
    target = {"a": torch.full((16,), -1.0)}
    with raises_in_dcp(CheckpointCorruptError, re.escape(why)):
        dcp.load(target, checkpoint_id=directory, storage_reader=DataStatesReader(),
                 no_dist=True)
    assert torch.equal(target["a"], torch.full((16,), -1.0))
    assert cli.main(["verify", "-q", str(directory)]) == 1
    assert why in capsys.readouterr().err


@pytest.mark.parametrize(("chunks", "why"), [
    ([((0, 0), (4, 4)), ((4, 0), (4, 2))], "chunks cover 24 of its 32 elements; elements "
                                           "[4:8, 2:4] are in no stored chunk"),
    ([((4, 0), (4, 4)), ((0, 0), (4, 4)), ((2, 2), (1, 1))], "chunks at [0, 0] and [2, 2] "
                                                             "overlap"),
    ([((0, 2), (8, 2)), ((0, 0), (8, 2))], None),
    ([((0, 0), (0, 4)), ((0, 0), (8, 4))], None),  # an empty chunk overlaps nothing
])
def test_tiling_problem_names_the_first_region_no_chunk_covers(chunks: list, why: str | None
                                                                ) -> None:
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 4]),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(n))
                                for o, n in chunks])
    assert tiling_problem(md) == why
    assert tiling_problem(md, whole=False) == (why if why and "overlap" in why else None)


@st.composite
def _chunked(draw) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    size = draw(st.lists(st.integers(0, 4), max_size=3))
    chunks = []
    for _ in range(draw(st.integers(0, 4))):
        off = [draw(st.integers(0, d)) for d in size]
        chunks.append((off, [draw(st.integers(0, d - o)) for o, d in zip(off, size, strict=True)]))
    return size, chunks


@settings(max_examples=300, deadline=None)
@given(case=_chunked())
def test_tiling_problem_agrees_with_counting_every_element(case) -> None:
    """Overlaps, holes and the first hole named, against each element's chunks counted."""
    size, chunks = case
    held: dict[tuple[int, ...], int] = {}
    for off, n in chunks:
        for point in itertools.product(*(range(o, o + k) for o, k in zip(off, n, strict=True))):
            held[point] = held.get(point, 0) + 1
    holes = [p for p in itertools.product(*(range(d) for d in size)) if p not in held]
    why = tiling_problem(TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks]))
    if any(count > 1 for count in held.values()):
        assert why is not None and why.endswith("overlap")
    elif holes:
        assert why is not None and why.startswith(f"chunks cover {len(held)} of")
        if size:
            first = re.search(r"elements \[(.*)\] are in no stored chunk", why)
            assert first is not None, why
            assert tuple(int(r.split(":")[0]) for r in first[1].split(", ")) in holes
    else:
        assert why is None
