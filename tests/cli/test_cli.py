"""``python -m dcp_datastates``: inspect, verify and export, on real checkpoints."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pty
import re
import select
import shutil
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import raises_in_dcp
from helpers.fakes import FaultyBackend
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from dcp_datastates import CheckpointCorruptError, DataStatesReader, DataStatesWriter, Engine
from dcp_datastates import _cli as cli
from dcp_datastates._cli.checkpoint import load_checkpoint
from dcp_datastates._cli.export import ENTRY_NAMES, EXPORT_NAMES
from dcp_datastates._cli.headers import check_file
from dcp_datastates._cli.inspect import inspect_data
from dcp_datastates._cli.output import OutputDir
from dcp_datastates._cli.progress import Progress
from dcp_datastates._cli.reads import chunk_reads
from dcp_datastates._cli.verify import ChunkCheck
from dcp_datastates._format.metadata_file import read_metadata, write_metadata
from dcp_datastates._io import ThreadPoolBackend

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
]


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
            "ids": torch.arange(10, dtype=torch.int64),
        },
        "opt": {"c": torch.randn(3, 2, dtype=torch.complex128, generator=g)},
        "step": 7,
    }


def _save(state: dict, path: Path) -> Path:
    with Engine(host_cache_size="16MiB", io_backend="threads") as engine:
        writer = DataStatesWriter(engine=engine)
        dcp.save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)
        assert engine.live_leases() == 0
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(_state(), tmp_path_factory.mktemp("ckpt") / "step_7")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcp_datastates", *args],
                          capture_output=True, text=True, timeout=60)


def _run_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """``python -m dcp_datastates ARGS`` with stderr on a pseudo-terminal: exit code, stdout,
    and what the terminal showed."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dcp_datastates", *args],
                                stdout=subprocess.PIPE, stderr=follower)
    finally:
        os.close(follower)
    shown = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if not select.select([leader], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the command ended, the terminal is closed
                break
            if not chunk:
                break
            shown += chunk
        out = proc.communicate(timeout=60)[0]
    finally:
        os.close(leader)
        proc.kill()
    return proc.returncode, out.decode(), shown.decode()


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``cli.main`` in this process (fast): exit code, stdout, stderr."""
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _data_file(path: Path) -> Path:
    (f,) = [p for p in path.iterdir() if p.suffix == ".safetensors"]
    return f


# -- inspect ------------------------------------------------------------------------------------
def test_inspect_table(ckpt: Path) -> None:
    res = _run("inspect", str(ckpt))
    assert res.returncode == 0, res.stderr
    lines = {ln.split()[0]: ln.split() for ln in res.stdout.splitlines() if ln.strip()}
    assert lines["model.w"][1:4] == ["tensor", "float32", "[64,"]
    assert lines["model.b"][1:3] == ["tensor", "bfloat16"]
    assert lines["opt.c"][2] == "complex128"
    assert lines["step"][1:4] == ["bytes", "-", "-"]
    assert _data_file(ckpt).name in res.stdout
    assert "total: 5 items (4 tensors" in res.stdout


def test_inspect_json(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", "--json", str(ckpt)]) == 0
    data = json.loads(capsys.readouterr().out)
    items = {i["fqn"]: i for i in data["items"]}
    assert set(items) == {"model.w", "model.b", "model.ids", "opt.c", "step"}
    assert items["model.w"] | {"files": None} == {
        "fqn": "model.w", "kind": "tensor", "dtype": "float32", "shape": [64, 32],
        "chunks": 1, "bytes": 64 * 32 * 4, "files": None}
    assert items["model.ids"]["dtype"] == "int64" and items["model.ids"]["shape"] == [10]
    assert items["step"]["kind"] == "bytes" and items["step"]["shape"] is None
    (f,) = data["files"]
    assert f["name"] == _data_file(ckpt).name and f["items"] == 5 and f["problem"] is None
    assert f["size"] == _data_file(ckpt).stat().st_size
    assert data["totals"]["items"] == 5 and data["totals"]["tensors"] == 4


def test_inspect_into_a_closed_pipe_exits_quietly(ckpt: Path) -> None:
    """stdout's reader gone before the output comes (``inspect | head -1``): no traceback, no
    error, the exit status of a command that SIGPIPE ended (141)."""
    proc = subprocess.Popen([sys.executable, "-m", "dcp_datastates", "inspect", str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # no reader left: the command's first write fails with EPIPE
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (141, b"")


# -- verify -------------------------------------------------------------------------------------
def test_verify_good(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys, "verify", str(ckpt))
    assert (code, err) == (0, "")  # stderr is no terminal here: no progress bar
    assert out.startswith("OK:")


@pytest.mark.parametrize("command", ["verify", "export"])
def test_progress_bar_only_on_a_terminal(ckpt: Path, tmp_path: Path, command: str) -> None:
    """Where stderr is a pipe or a log the bar prints nothing (not a line per step); on a
    terminal it is one line, rewritten in place, ended at 100%."""
    args = [command, str(ckpt)] + ([str(tmp_path / "hf"), "--prefix", "model."]
                                   if command == "export" else [])
    piped = _run(*args)
    assert (piped.returncode, piped.stderr) == (0, "")
    code, out, shown = _run_on_a_terminal(*args)
    assert code == 0, shown
    assert out.startswith("OK:" if command == "verify" else "exported 3 tensors")
    desc = {"verify": "verifying", "export": "exporting"}[command]
    assert shown.startswith(f"\r{desc}:   0%") and shown.endswith("\r\n"), shown
    assert f"\r{desc}: 100% (" in shown and shown.count("\n") == 1, shown


def test_verify_flipped_byte(ckpt: Path, tmp_path: Path) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    loc = next(v for k, v in read_metadata(bad).storage_data.items() if k.fqn == "model.w")
    f = bad / loc.file
    raw = bytearray(f.read_bytes())
    raw[loc.offset + 100] ^= 0x01
    f.write_bytes(raw)
    res = _run("verify", "-q", str(bad))
    assert res.returncode == 1
    assert f"file {loc.file}, item 'model.w'" in res.stderr and "checksum mismatch" in res.stderr
    assert f"item bytes 0..{loc.length}" in res.stderr
    assert "model.b" not in res.stderr  # only the damaged item is reported


def test_verify_truncated_and_missing(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    f = _data_file(bad)
    locs = read_metadata(bad).storage_data
    last = max(locs, key=lambda k: locs[k].offset + locs[k].length)
    with open(f, "r+b") as fh:
        fh.truncate(locs[last].offset + 1)
    code, _, err = _main(capsys, "verify", "-q", str(bad))
    assert code == 1
    assert f"file {f.name}, item {last.fqn!r}" in err and "truncated" in err
    f.unlink()
    code, _, err = _main(capsys, "verify", "-q", str(bad))
    assert code == 1
    assert f"file {f.name} is missing (5 stored chunks live there)" in err


# -- files that are not regular files -----------------------------------------------------------
def _plant(directory: Path, name: str, kind: str, outside: Path) -> Path:
    """Replace ``directory/name`` with a FIFO, a device (/dev/null's), or a link to a copy of
    it in ``outside``."""
    target = directory / name
    target.rename(outside / name)
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        try:
            os.mknod(target, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
        except PermissionError:
            pytest.skip("no permission to make a device node here")
    else:
        target.symlink_to(outside / name)
    return target


def _main_promptly(capsys: pytest.CaptureFixture[str], planted: Path,
                   *args: str) -> tuple[int, str, str]:
    """``_main``, failing (not hanging) if the command waits on the FIFO ``planted``."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_main, capsys, *args)
        try:
            return future.result(timeout=60)
        finally:
            if not future.done():  # a regression: open the FIFO's ends to free the command
                r = os.open(planted, os.O_RDONLY | os.O_NONBLOCK)
                os.close(os.open(planted, os.O_WRONLY | os.O_NONBLOCK))
                os.close(r)


WHY = {"fifo": "is not a regular file (a FIFO)", "device": "is not a regular file (a device)",
       "symlink": "is a symbolic link (checkpoint files are never opened through one)"}


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_metadata_that_is_not_a_regular_file_is_refused(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, kind: str
) -> None:
    """Refused at once: a FIFO is not waited on, a link (here, to an intact copy of the very
    file, outside the checkpoint) is not followed."""
    bad = _copy(ckpt, tmp_path / "bad")
    planted = _plant(bad, ".metadata", kind, tmp_path)
    args = [str(tmp_path / "hf")] if command == "export" else []
    code, out, err = _main_promptly(capsys, planted, command, str(bad), *args)
    assert code == 1, out
    assert f"error: {planted} {WHY[kind]}" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "symlink"])
def test_data_file_that_is_not_a_regular_file_is_refused(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    planted = _plant(bad, _data_file(bad).name, kind, tmp_path)
    code, _, err = _main_promptly(capsys, planted, "verify", "-q", str(bad))
    assert code == 1
    assert f"file {planted.name} {WHY[kind]} (5 stored chunks live there)" in err
    code, _, err = _main_promptly(capsys, planted, "export", "-q", str(bad), str(tmp_path / "hf"))
    assert code == 1
    assert f"file {planted.name}, item 'model." in err
    assert f"the data file {WHY[kind]}" in err
    code, out, err = _main_promptly(capsys, planted, "inspect", str(bad))
    assert code == 0 and "model.w" in out  # the listing comes from .metadata; the file is flagged
    assert f"warning: data file {planted.name} {WHY[kind]}" in err


def test_paths_expand_home(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``~`` in PATH and OUT is the home directory (quoted, a shell leaves it to us)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    _copy(ckpt, home / "ckpt")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    code, out, err = _main(capsys, "inspect", "~/ckpt")
    assert code == 0 and "model.w" in out, err
    code, _, err = _main(capsys, "export", "-q", "~/ckpt", "~/hf", "--prefix", "model.")
    assert code == 0, err
    _assert_exported([home / "hf" / "model.safetensors"], _state()["model"])
    assert not any(work.iterdir())  # no literal "./~"


# -- export -------------------------------------------------------------------------------------
def _assert_exported(files: list[Path], expected: dict[str, torch.Tensor]) -> None:
    """The safetensors files hold exactly ``expected``, bit for bit."""
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got |= load_file(f)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


_WITHOUT_NUMPY = """
import importlib.abc, sys
class _NoNumpy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "numpy":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, _NoNumpy())
from dcp_datastates._cli import main
code = main(sys.argv[1:])
assert "numpy" not in sys.modules
sys.exit(code)
"""


def test_export_without_numpy(ckpt: Path, tmp_path: Path) -> None:
    """numpy is no dependency: export writes the safetensors files itself."""
    out = tmp_path / "hf"
    res = subprocess.run([sys.executable, "-c", _WITHOUT_NUMPY, "export", "-q", str(ckpt),
                          str(out), "--prefix", "model.", "--max-shard-size", "4KiB"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "exported 3 tensors" in res.stdout
    _assert_exported(sorted(out.glob("*.safetensors")), _state()["model"])


@pytest.mark.parametrize("inside", ["child", "itself", "through a link"])
def test_export_refuses_an_output_inside_the_checkpoint(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], inside: str
) -> None:
    (tmp_path / "link").symlink_to(ckpt)
    out = {"child": ckpt / "hf", "itself": ckpt / "sub" / "..",
           "through a link": tmp_path / "link" / "hf"}[inside]
    before = sorted(p.name for p in ckpt.iterdir())
    code, _, err = _main(capsys, "export", str(ckpt), str(out))
    assert code == 1
    assert f"error: output directory {out} is inside the checkpoint directory {ckpt}" in err
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_export_replaces_what_sits_at_an_output_name(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO (or a link) at the output file's name is replaced, never written through."""
    out = tmp_path / "hf"
    out.mkdir()
    os.mkfifo(out / "model.safetensors")
    code, _, err = _main_promptly(capsys, out / "model.safetensors", "export", "-q", str(ckpt),
                                  str(out), "--prefix", "model.")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    _assert_exported([out / "model.safetensors"], _state()["model"])


@pytest.mark.parametrize("first, second", [("5GB", "4KiB"), ("4KiB", "5GB")])
def test_export_again_leaves_no_stale_files(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], first: str, second: str
) -> None:
    """Exporting again into the same directory with another sharding removes the previous
    export's files: a stale model.safetensors next to a new index (loaders take the single
    file first) would hand out the old weights."""
    out = tmp_path / "hf"
    (out / "keep").mkdir(parents=True)
    (out / "README.md").write_text("mine")
    for size in (first, second):
        code, _, err = _main(capsys, "export", "-q", str(ckpt), str(out), "--prefix", "model.",
                             "--max-shard-size", size)
        assert code == 0, err
    names = sorted(p.name for p in out.iterdir())
    if second == "5GB":
        assert names == ["README.md", "keep", "model.safetensors"]
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert names == sorted(["README.md", "keep", "model.safetensors.index.json", *shards])
    _assert_exported(sorted(out.glob("*.safetensors")), _state()["model"])


def test_export_refuses_the_checkpoint_seen_through_a_bind_mount(
    ckpt: Path, tmp_path: Path
) -> None:
    """The same directory under another path that no link explains (a bind mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (f"mount --bind {ckpt} {mnt} && exec {sys.executable} -m dcp_datastates export "
              f"-q {ckpt} {mnt / 'hf'}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         timeout=60)
    if "mount" in res.stderr and res.returncode != 1 or "unshare" in res.stderr:
        pytest.skip(f"cannot bind-mount here: {res.stderr.strip()}")
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"output directory {mnt / 'hf'} is inside the checkpoint directory {ckpt}" in res.stderr
    assert not (ckpt / "hf").exists()


def _tamper_chunks(directory: Path, how: str) -> None:
    """Rewrite ``.metadata`` so that item "a"'s chunks do not tile its global shape."""
    md = read_metadata(directory)
    a = md.state_dict_metadata["a"]
    if how == "smaller":
        a.size = torch.Size([4])
    elif how == "larger":
        a.size = torch.Size([16])
    elif how == "rank":
        a.size = torch.Size([8, 1])
    else:  # "overlap": p and q become chunks [0, 4) and [2, 6) of an "a" of 8: 6..8 never written
        locs = {i.fqn: loc for i, loc in md.storage_data.items()}
        for fqn in ("p", "q"):
            del md.state_dict_metadata[fqn]
        md.storage_data = {i: loc for i, loc in md.storage_data.items() if i.fqn not in "pq"}
        a.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
                    ChunkStorageMetadata(torch.Size([2]), torch.Size([4]))]
        md.storage_data = {MetadataIndex("a", [0]): locs["p"], MetadataIndex("a", [2]): locs["q"]}
    write_metadata(directory, md, "test")


@pytest.mark.parametrize(("how", "why"), [
    ("smaller", ": item 'a': chunk at [0] of shape [8] lies outside the tensor's shape [4]"),
    ("larger", ": item 'a': chunks cover 8 of its 16 elements"),
    ("rank", "/.metadata: item 'a', chunk 0: its offsets [0] have 1 dimension(s) where the "
             "tensor has 2"),
    ("overlap", ": item 'a': chunks at [0] and [2] overlap"),
])
def test_chunks_that_do_not_tile_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, why: str
) -> None:
    """A ``.metadata`` whose chunks do not tile a tensor's global shape: ``verify`` names it
    (a chunk with another number of dimensions than its tensor: as ``.metadata`` is read);
    a load refuses it with the same words; ``export`` refuses it with an error (no traceback,
    no uninitialized memory exported)."""
    directory = _save({"a": torch.arange(8.0), "p": torch.arange(4.0),
                       "q": torch.arange(4.0) + 10}, tmp_path / "ckpt")
    _tamper_chunks(directory, how)
    code, _, err = _main(capsys, "verify", "-q", str(directory))
    assert code == 1
    assert f"{directory}{why}" in err, err
    md = read_metadata(directory)
    target = {fqn: torch.full(tuple(tmd.size), -1.0) for fqn, tmd in md.state_dict_metadata.items()}
    with raises_in_dcp(CheckpointCorruptError, re.escape(f"{directory}{why}")):
        dcp.load(target, checkpoint_id=directory, storage_reader=DataStatesReader(), no_dist=True)
    assert all(bool((t == -1).all()) for t in target.values())
    res = _run("export", "-q", str(directory), str(tmp_path / "hf"))
    assert res.returncode == 1, res.stdout
    assert "Traceback" not in res.stderr
    assert f"error: {directory}{why}" in res.stderr, res.stderr
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_export_single_file(ckpt: Path, tmp_path: Path) -> None:
    res = _run("export", str(ckpt), str(tmp_path / "hf"), "--prefix", "model.")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    _assert_exported([tmp_path / "hf" / "model.safetensors"], _state()["model"])


def test_export_skips_and_shards(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    code, _, err = _main(capsys, "export", str(ckpt), str(out), "--max-shard-size", "4KiB")
    assert code == 0, err
    assert "step" in err and "opt.c (complex128)" in err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"model.w", "model.b", "model.ids"}
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(out / f)
        assert all(index["weight_map"][k] == f for k in part)
        merged |= part
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in merged.values())
    for k, v in _state()["model"].items():
        assert torch.equal(merged[f"model.{k}"].view(torch.uint8), v.view(torch.uint8))


def test_quiet_export_prints_no_notes(ckpt: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``-q``: no notes (an item skipped, an earlier export's files removed); a warning (a
    tensor not exported) and errors still show."""
    out = tmp_path / "hf"
    code, _, err = _main(capsys, "export", str(ckpt), str(out), "--max-shard-size", "4KiB")
    assert code == 0 and "note: skipped 1 non-tensor item(s): step" in err, err
    code, stdout, err = _main(capsys, "export", "-q", str(ckpt), str(out))
    assert code == 0 and stdout.startswith("exported 3 tensors"), err
    assert err == ("warning: skipped 1 tensor(s) with dtypes safetensors cannot hold: "
                   "opt.c (complex128)\n")  # no note, and it removed shards of the first one
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    code, _, err = _main(capsys, "export", "-q", str(ckpt), str(out / "model.safetensors"),
                         "--prefix", "model.")
    assert code == 1 and err.startswith("error: output directory "), err


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"rows": torch.randn(5, 3, generator=g), "cols": torch.randn(4, 7, generator=g),
            "rep": torch.randn(6, generator=g).to(torch.float16)}


def _rank_save(rank: int, store_path: str, ckpt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = _full_tensors()
        state = {"model": {
            "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        }}
        with Engine(host_cache_size="16MiB", io_backend="threads") as engine:
            dcp.save(state, checkpoint_id=ckpt, storage_writer=DataStatesWriter(engine=engine))
    finally:
        dist.destroy_process_group()


def test_export_stitches_sharded_dtensors(tmp_path: Path) -> None:
    ckpt = tmp_path / "sharded"
    mp.spawn(_rank_save, args=(str(tmp_path / "store"), str(ckpt)), nprocs=2, join=True)
    data = inspect_data(ckpt)
    items = {i["fqn"]: i for i in data["items"]}
    assert items["model.rows"]["chunks"] == 2 and items["model.cols"]["chunks"] == 2
    assert items["model.rows"]["shape"] == [5, 3] and len(data["files"]) == 2
    assert cli.main(["verify", "-q", str(ckpt)]) == 0
    assert cli.main(["export", "-q", str(ckpt), str(tmp_path / "hf"), "--prefix", "model."]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for k, v in _full_tensors().items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


# -- help ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "words"), [
    ("inspect", "list every item"), ("verify", "checksums"), ("export", "safetensors")])
def test_help(command: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and words in out and "PATH" in out


def test_help_subprocess() -> None:
    res = _run("--help")
    assert res.returncode == 0
    assert all(c in res.stdout for c in ("inspect", "verify", "export"))


def test_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(capsys, "inspect", str(tmp_path))
    assert code == 1 and ".metadata is missing" in err


# -- reading through the load job ---------------------------------------------------------------
def _flip(directory: Path, fqn: str, at: int) -> None:
    """Flip one bit of item ``fqn``'s byte ``at`` in its data file."""
    loc = next(v for k, v in read_metadata(directory).storage_data.items() if k.fqn == fqn)
    f = directory / loc.file
    raw = bytearray(f.read_bytes())
    raw[loc.offset + at] ^= 0x01
    f.write_bytes(raw)


def _many() -> dict[str, torch.Tensor]:
    return {f"t{i:02d}": torch.full((16,), float(i)) for i in range(40)} | {
        "big": torch.arange(300 * 257, dtype=torch.float32).view(300, 257)}


def test_verify_names_every_damaged_item(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """One run names each damaged item (not only the first), and no intact one."""
    directory = _save(_many(), tmp_path / "ckpt")
    for fqn, at in (("t03", 4), ("t31", 60), ("big", 200 * 257 * 4)):
        _flip(directory, fqn, at)
    code, _, err = _main(capsys, "verify", "-q", str(directory))
    assert code == 1
    assert "3 problem(s)" in err, err
    for fqn in ("t03", "t31", "big"):
        assert f"item {fqn!r}: checksum mismatch" in err
    assert "'t04'" not in err and "'t30'" not in err


def test_verify_reads_large_chunks_in_bounded_slices(tmp_path: Path) -> None:
    """Batches and slices far smaller than the checkpoint: every byte is still counted, and
    the damaged item is found among the slices."""
    directory = _save(_many(), tmp_path / "ckpt")
    _flip(directory, "big", 250 * 257 * 4)
    md, chunks = load_checkpoint(directory)
    (name,) = {c.loc.file for cs in chunks.values() for c in cs}
    everything = [c for cs in chunks.values() for c in cs]
    total = sum(c.loc.length for c in everything)
    found = check_file(directory, md, name, everything)
    assert found.problems == [] and len(found.readable) == len(everything)
    progress = Progress(total, "verifying", enabled=False)
    with Engine(host_cache_size="16MiB", io_backend="threads") as engine:
        check = ChunkCheck(engine, directory, md, progress, batch_bytes=64 << 10,
                           slice_bytes=16 << 10)
        problems = check.problems(found.readable)
    assert len(problems) == 1 and "item 'big': checksum mismatch" in problems[0]
    assert progress.done == total


def test_verify_of_many_damaged_items_reads_each_once(tmp_path: Path) -> None:
    """Hundreds of damaged items: each is named, and each stored byte is read about once (not
    once per damaged item before it: a load job per damaged item made verify quadratic)."""
    state = {f"t{i:03d}": torch.full((64,), float(i)) for i in range(300)}
    directory = _save(state, tmp_path / "ckpt")
    md = read_metadata(directory)
    (name,) = {loc.file for loc in md.storage_data.values()}
    raw = bytearray((directory / name).read_bytes())
    for loc in md.storage_data.values():
        raw[loc.offset + 5] ^= 0x01
    (directory / name).write_bytes(raw)
    md, chunks = load_checkpoint(directory)
    everything = [c for cs in chunks.values() for c in cs]
    found = check_file(directory, md, name, everything)
    backend = FaultyBackend(ThreadPoolBackend())
    progress = Progress(sum(c.loc.length for c in everything), "verifying", enabled=False)
    with Engine(host_cache_size="16MiB", io_backend=backend) as engine:
        problems = ChunkCheck(engine, directory, md, progress).problems(found.readable)
    assert len(problems) == len(state)
    assert all("checksum mismatch" in p for p in problems)
    assert backend.reads < 30, f"{backend.reads} reads for {len(state)} damaged items"


@pytest.mark.parametrize(("block", "rows"), [(400, 20), (1024, 25)])
def test_chunk_reads_cut_whole_rows_on_block_ends(block: int, rows: int) -> None:
    """A (100, 10) float32 chunk in slices of at most 1000 bytes: whole rows, on checksum
    block ends where the rows allow (40-byte rows make 400-byte blocks, not 1024-byte ones)."""
    index = MetadataIndex("w", [100, 0])
    reads = chunk_reads(index, (100, 10), 4, block, MetadataIndex("w", [0, 0]), [100, 0],
                        slice_bytes=1000)
    assert [r.storage_offsets[0] for r in reads] == list(range(0, 100, rows))
    assert sum(r.lengths[0] for r in reads) == 100
    assert all(r.lengths[1] == 10 and r.storage_offsets[1] == 0 for r in reads)
    assert [r.dest_offsets[0] - 100 for r in reads] == [r.storage_offsets[0] for r in reads]
    assert all(r.storage_index == index for r in reads)


def test_export_refuses_a_damaged_chunk(ckpt: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Export reads with checksums: a damaged chunk is refused, naming file and item, and
    nothing is left in the output directory; --no-verify exports it as stored."""
    bad = _copy(ckpt, tmp_path / "bad")
    _flip(bad, "model.w", 100)
    out = tmp_path / "hf"
    code, _, err = _main(capsys, "export", "-q", str(bad), str(out), "--prefix", "model.")
    assert code == 1
    name = _data_file(bad).name
    assert f"file {name}, item 'model.w': checksum mismatch" in err, err
    assert list(out.iterdir()) == []
    code, _, err = _main(capsys, "export", "-q", "--no-verify", str(bad), str(out),
                         "--prefix", "model.")
    assert code == 0, err
    assert not torch.equal(load_file(out / "model.safetensors")["w"], _state()["model"]["w"])


def test_export_writes_through_temporary_names(ckpt: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A file at the output name is replaced by a rename, never written in place: a hard
    link to it elsewhere keeps its bytes, and no temporary file is left."""
    out = tmp_path / "hf"
    out.mkdir()
    (tmp_path / "mine").write_bytes(b"keep me")
    os.link(tmp_path / "mine", out / "model.safetensors")
    code, _, err = _main(capsys, "export", "-q", str(ckpt), str(out), "--prefix", "model.")
    assert code == 0, err
    assert (tmp_path / "mine").read_bytes() == b"keep me"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    _assert_exported([out / "model.safetensors"], _state()["model"])


def test_export_checks_a_declared_4_tib_tensor_before_allocating_it(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``.metadata`` that declares a 4 TiB tensor its data file does not hold: refused at
    once, naming the file and the item, before any memory is allocated or anything written."""
    bad = _copy(ckpt, tmp_path / "bad")
    md = read_metadata(bad)
    w = md.state_dict_metadata["model.w"]
    (chunk,) = w.chunks
    size = torch.Size([1 << 20, 1 << 20])
    w.size = size
    w.chunks = [dataclasses.replace(chunk, sizes=size)]
    index = next(i for i in md.storage_data if i.fqn == "model.w")
    loc = md.storage_data[index]
    length = 4 << 40
    md.storage_data[index] = dataclasses.replace(
        loc, length=length, checksums=(0,) * -(-length // loc.block))
    write_metadata(bad, md, "0123456789abcdef")
    out = tmp_path / "hf"
    start = time.monotonic()
    code, _, err = _main(capsys, "export", "-q", str(bad), str(out), "--prefix", "model.")
    assert time.monotonic() - start < 1.0
    assert code == 1
    assert err == (f"error: {bad}: file {loc.file}, item 'model.w' (chunk at [0, 0]): truncated: "
                   f"needs file bytes {loc.offset}..{loc.offset + length}, the data file has "
                   f"{(bad / loc.file).stat().st_size}\n")
    assert not out.exists()


@pytest.mark.parametrize("what", ["a file", "under a file", "a link to nothing",
                                  "under a link to nothing", "a link to a file", "a device"])
def test_export_to_a_file_says_so(ckpt: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str], what: str) -> None:
    """An output path that is no directory, or lies under one, is refused naming the path in
    the way, what it is and what to do."""
    (tmp_path / "file").write_bytes(b"mine")
    (tmp_path / "nothing").symlink_to(tmp_path / "missing")
    (tmp_path / "to-file").symlink_to(tmp_path / "file")
    out = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "hf",
           "a link to nothing": tmp_path / "nothing",
           "under a link to nothing": tmp_path / "nothing" / "hf",
           "a link to a file": tmp_path / "to-file", "a device": Path("/dev/null")}[what]
    code, _, err = _main(capsys, "export", "-q", str(ckpt), str(out), "--prefix", "model.")
    assert code == 1
    other = "give another output directory (a missing one is made)\n"
    assert err == {
        "a file": f"error: output directory {out} is a file: remove it, or {other}",
        "under a file": f"error: cannot make the output directory {out}: {tmp_path / 'file'} "
                        f"is a file: remove it, or {other}",
        "a link to nothing": f"error: output directory {out} is a link to "
                             f"{tmp_path / 'missing'}, which does not exist: make that "
                             f"directory or remove the link, or {other}",
        "under a link to nothing": f"error: cannot make the output directory {out}: "
                                   f"{tmp_path / 'nothing'} is a link to {tmp_path / 'missing'}, "
                                   f"which does not exist: make that directory or remove the "
                                   f"link, or {other}",
        "a link to a file": f"error: output directory {out} is a link to {tmp_path / 'file'}, "
                            f"a file: remove the link, or {other}",
        "a device": f"error: output directory {out} is not a directory: {other}",
    }[what]
    assert (tmp_path / "file").read_bytes() == b"mine"
    assert not (tmp_path / "missing").exists()


def test_two_exports_into_one_directory_cannot_interleave(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    with OutputDir(out):
        code, _, err = _main(capsys, "export", "-q", str(ckpt), str(out), "--prefix", "model.")
    assert code == 1
    assert err == (f"error: output directory {out} is being written by another export: wait "
                   f"for it to finish or export elsewhere\n")
    code, _, err = _main(capsys, "export", "-q", str(ckpt), str(out), "--prefix", "model.")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_output_dir_syncs_each_file_before_its_rename_then_the_directories(
    tmp_path: Path,
) -> None:
    """Each file is synced under its temporary name in the staging directory, then that
    directory; the output directory once the previous files went, again before the entry
    file comes, and once everything is in place, with the parents it was made in."""
    synced: list[str] = []

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        os.fsync(fd)

    with OutputDir(tmp_path / "a" / "b", fsync=fsync) as out:
        out.write("x.safetensors", [b"12", memoryview(b"34")])
        out.write("y.json", [b"{}"])
        assert out.publish(re.compile("^$"), {"y.json"}) == []
    tmp_x, tmp_y, *dirs = synced
    staging = Path(tmp_x).parent
    assert staging.parent == out.path and staging.name.startswith(".export-")
    assert (tmp_x, tmp_y) == (str(staging / ".x.safetensors.tmp"), str(staging / ".y.json.tmp"))
    assert dirs == [str(staging), *[str(out.path)] * 3, str(tmp_path / "a"), str(tmp_path)]
    assert (out.path / "x.safetensors").read_bytes() == b"1234"
    assert sorted(p.name for p in out.path.iterdir()) == ["x.safetensors", "y.json"]


_SHARDED = {"model-00001-of-00002.safetensors": b"shard 1", "model.safetensors.index.json":
            b"index", "model-00002-of-00002.safetensors": b"shard 2"}


@pytest.mark.parametrize(("old", "new"), [
    (_SHARDED, {"model.safetensors": b"single"}),
    ({"model.safetensors": b"single"}, _SHARDED),
    (_SHARDED, {k: v + b" again" for k, v in _SHARDED.items()}),
], ids=["sharded to single", "single to sharded", "sharded again"])
def test_an_export_stopped_anywhere_leaves_the_old_model_whole_or_none(
    tmp_path: Path, old: dict[str, bytes], new: dict[str, bytes]
) -> None:
    """Stopped at each of its syncs (a failing one, as a crash there would stop it), an export
    leaves the previous export whole, or no entry file (no model a loader takes), never a mix;
    the next export then goes through and removes what the stopped one left."""
    out = tmp_path / "hf"
    for stop in range(1, 20):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        (out / "README.md").write_bytes(b"mine")
        for name, data in old.items():
            (out / name).write_bytes(data)
        calls = 0

        def fsync(fd: int, stop: int = stop) -> None:
            nonlocal calls
            calls += 1
            if calls == stop:
                raise OSError(errno.EIO, "stopped here (injected)")
            os.fsync(fd)

        try:
            with OutputDir(out, fsync=fsync) as o:
                for name, data in new.items():
                    o.write(name, [data])
                o.publish(EXPORT_NAMES, ENTRY_NAMES)
            finished = True
        except OSError:
            finished = False
        files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        models = {n: d for n, d in files.items() if EXPORT_NAMES.match(n)}
        assert files["README.md"] == b"mine"
        assert models in (old, new) or not ENTRY_NAMES & set(models), (stop, models)
        if finished:
            assert models == new and sorted(files) == sorted([*new, "README.md"])
            assert not list(out.glob(".export-*"))
            break
    else:
        pytest.fail("the export never finished")
    assert stop > 3, "the export should have been stopped at several points first"
