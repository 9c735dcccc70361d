"""Checksums made on the GPU beside a snapshot's copies: equal to the CPU's, used by the commit,
verified by a load."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import raises_in_dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine
from dcp_datastates._cuda import cuda_copy
from dcp_datastates._cuda.gpu_sums import GPU_SUM_BLOCK, GpuHashes, GpuSums
from dcp_datastates._format import checksums
from dcp_datastates._format.metadata_file import read_metadata
from dcp_datastates.errors import CheckpointCorruptError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def built(copier: cuda_copy.CudaCopier, device: int = 0) -> None:
    """Start building the device's kernel and wait for it (it is built in the background)."""
    deadline = time.monotonic() + 60
    while not copier.sums.ready(device):
        assert time.monotonic() < deadline, "the checksum kernel was not built in 60 s"
        time.sleep(0.05)


def test_gpu_digests_equal_libdcp_hash_and_the_xxhash_package() -> None:
    """Sources of odd sizes at odd addresses, one longer than a block: each source's digests
    as the CPU computes them from the bytes the copies brought over."""
    copier = cuda_copy.CudaCopier()
    try:
        built(copier)
        data = torch.randint(0, 256, (3 * GPU_SUM_BLOCK,), dtype=torch.uint8, device="cuda")
        spans = [(1, 3), (0, 0), (5, 241), (8, 4096 + 7), (3, GPU_SUM_BLOCK + 1000),
                 (0, 2 * GPU_SUM_BLOCK), (64, 1024 * 5 + 1)]
        hosts = [torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True) for _, n in spans]
        copies = [(0, h.data_ptr(), data.data_ptr() + at, n)
                  for h, (at, n) in zip(hosts, spans, strict=True)]
        keys = [10 + k for k in range(len(spans))]
        issued = copier.issue(copies, "d2h", checksums=keys)
        issued.wait()
        for key, host, (_, n) in zip(keys, hosts, spans, strict=True):
            want = checksums.block_checksums(host.data_ptr(), n, GPU_SUM_BLOCK)
            assert issued.checksums[key] == want, (key, n)
        assert len(issued.checksums[keys[4]]) == 2
    finally:
        copier.close()


def digests_of_a_copy(copier: cuda_copy.CudaCopier, device: int) -> tuple[list[int], list[int]]:
    """Copy 3 MiB of ``device`` into host memory pinned by the copier (not by torch) with
    checksums: (GPU digests, CPU digests)."""
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device=f"cuda:{device}")
    host = torch.empty(data.numel(), dtype=torch.uint8)
    copier.pin(host.data_ptr(), host.numel())
    try:
        issued = copier.issue([(device, host.data_ptr(), data.data_ptr(), data.numel())],
                              "d2h", checksums=[7])
        issued.wait()
    finally:
        copier.unpin(host.data_ptr(), host.numel())
    return (issued.checksums.get(7, []),
            checksums.block_checksums(host.data_ptr(), host.numel(), GPU_SUM_BLOCK))


class FailingSums(GpuSums):
    def launch(self, device: int, after: object, blocks: list[tuple[int, int]]) -> GpuHashes:
        raise RuntimeError("cuLaunchKernel failed: injected")


def test_a_failing_kernel_leaves_the_checksums_to_the_cpu_and_the_copies_go_on(
        caplog: pytest.LogCaptureFixture) -> None:
    copier = cuda_copy.CudaCopier(sums=FailingSums())
    try:
        built(copier)
        gpu, cpu = digests_of_a_copy(copier, 0)
        assert gpu == [] and cpu
        assert not copier.sums.ready(0)
        assert "the GPU checksum kernel failed on device 0 (cuLaunchKernel failed: injected)" \
            in caplog.text
    finally:
        copier.close()


def test_a_commit_takes_the_gpu_checksums_and_a_load_verifies_them(tmp_path) -> None:
    """Once the kernel is built, an async save's GPU tensors carry block digests of
    GPU_SUM_BLOCK bytes (made on the GPU as they were snapshot), its CPU tensors the CPU's; a
    load returns the bytes, and a byte changed in the file is caught."""
    engine = Engine(host_cache_size="256MiB")
    try:
        built(engine.cuda)
        gen = torch.Generator(device="cuda").manual_seed(5)
        state = {"w": torch.randn(3000, 1001, device="cuda", generator=gen),  # 11.5 MiB
                 "b": torch.randn(7, device="cuda", generator=gen).bfloat16(),
                 "cpu": torch.arange(5000, dtype=torch.int64)}
        want = {k: v.cpu().clone() for k, v in state.items()}
        dcp.async_save(state, checkpoint_id=tmp_path / "ck", no_dist=True,
                       storage_writer=DataStatesWriter(engine=engine)).upload_completion.result()
        blocks = {fqn: loc.block for fqn, loc in _locations(tmp_path / "ck").items()}
        assert blocks == {"w": GPU_SUM_BLOCK, "b": GPU_SUM_BLOCK,
                          "cpu": checksums.BLOCK_BYTES}, blocks
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, checkpoint_id=tmp_path / "ck", no_dist=True,
                 storage_reader=DataStatesReader(engine=engine))
        for k, v in want.items():
            assert torch.equal(out[k].cpu(), v), k
        loc = _locations(tmp_path / "ck")["w"]
        path = tmp_path / "ck" / loc.file
        raw = bytearray(path.read_bytes())
        raw[loc.offset + 5 * GPU_SUM_BLOCK // 2] ^= 0x40
        path.write_bytes(bytes(raw))
        with raises_in_dcp(CheckpointCorruptError, rf"item 'w': checksum mismatch in item "
                           rf"bytes {2 * GPU_SUM_BLOCK}\.\.{3 * GPU_SUM_BLOCK};"):
            dcp.load(out, checkpoint_id=tmp_path / "ck", no_dist=True,
                     storage_reader=DataStatesReader(engine=engine))
    finally:
        engine.close()


def _locations(directory) -> dict:
    meta = read_metadata(directory)
    return {index.fqn: loc for index, loc in meta.storage_data.items()}
