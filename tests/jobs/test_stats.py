"""Every save and load reports its figures: one log line each, and ``last_stats()``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_state_equal, blank_like, clone_state, rand_tensor

from dcp_datastates import DataStatesReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    return {"w": rand_tensor((512, 300), torch.float32, seed=1),
            "b": rand_tensor((300,), torch.bfloat16, seed=2), "step": 7}


def _tensor_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def test_async_save_stats_and_log_line(tmp_path: Path, make_writer, caplog) -> None:
    state = _state()
    writer = make_writer(host_cache_size="8MiB")
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        resp = dcp.async_save(state, checkpoint_id=tmp_path / "ck", storage_writer=writer,
                              no_dist=True)
        resp.upload_completion.result()
    st = writer.last_stats()
    assert st.backend in ("uring", "threads")
    # (no order between blocking_s and snapshot_s: on CPU the staging thread may finish the
    # snapshot before the async_save caller gets the GIL back to record its own time)
    assert 0 <= st.blocking_s <= st.durable_s and 0 <= st.snapshot_s <= st.durable_s
    assert 0 < st.flush_s <= st.durable_s
    assert st.staged_bytes == _tensor_bytes(state) and st.overflow_bytes == 0
    files = sorted((tmp_path / "ck").glob("*.safetensors"))
    assert st.bytes_written == sum(f.stat().st_size for f in files)
    lines = [r.getMessage() for r in caplog.records if "dcp_datastates save:" in r.getMessage()]
    assert len(lines) == 1 and f"backend={st.backend}" in lines[0] and "GiB/s" in lines[0]


def test_sync_save_has_no_snapshot_and_overflow_is_counted(tmp_path: Path, make_writer) -> None:
    state = _state()
    writer = make_writer(host_cache_size="512KiB")  # 384 KiB for snapshots, 128 for flushes
    dcp.save(state, checkpoint_id=tmp_path / "a", storage_writer=writer, no_dist=True)
    assert writer.last_stats().snapshot_s is None and writer.last_stats().blocking_s is None
    resp = dcp.async_save(state, checkpoint_id=tmp_path / "b", storage_writer=writer,
                          no_dist=True)
    resp.upload_completion.result()
    st = writer.last_stats()
    assert st.overflow_bytes >= 512 * 300 * 4  # the 600 KiB matrix cannot fit
    assert st.staged_bytes + st.overflow_bytes == _tensor_bytes(state)


def test_load_stats_and_log_line(tmp_path: Path, make_writer, caplog) -> None:
    state = _state()
    expected = clone_state(state)
    dcp.save(state, checkpoint_id=tmp_path, storage_writer=make_writer(host_cache_size="8MiB"),
             no_dist=True)
    reader = DataStatesReader(verify_checksums=False)
    out = blank_like(state)
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        dcp.load(out, checkpoint_id=tmp_path, storage_reader=reader, no_dist=True)
    assert_state_equal(out, expected)
    st = reader.last_stats()
    assert st.bytes_read > _tensor_bytes(state) and st.seconds > 0 and not st.verified
    lines = [r.getMessage() for r in caplog.records if "dcp_datastates load:" in r.getMessage()]
    assert len(lines) == 1 and "not checked" in lines[0]
