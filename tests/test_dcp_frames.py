"""The DCP frames the package reads (``dcp_datastates/_dcp_frames.py``) are still there on the
installed torch: each DCP function still exists, still has the locals read from it, and still
makes the call through which its frame is reached. A torch release that changes one fails
here (CI runs the suite on each supported torch)."""

from __future__ import annotations

from types import CodeType

import pytest

from dcp_datastates import _dcp_frames as dcp_frames
from dcp_datastates._dcp_frames import DCP_DIR, Where, dcp_code, dcp_locals

#: Each read, by its name in dcp_frames, and the call (of our writer or reader, or the
#: unpickling) made in its DCP function or in one nested in it.
WHERES = {name: value for name, value in vars(dcp_frames).items() if isinstance(value, Where)}
CALLS = {"ASYNC_SAVE": "stage", "LOAD_STEP": "set_up_storage_reader", "READ_METADATA": "load"}


def _missing(where: Where) -> list[str]:
    """The locals ``where`` reads that its DCP function lacks (all: no such function)."""
    code = dcp_code(where.function)
    if code is None:
        return list(where.names)
    held = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    return [name for name in where.names if name not in held]


def _calls(code: CodeType) -> set[str]:
    """The names ``code`` and the functions nested in it look up (the calls among them)."""
    return set(code.co_names).union(*(_calls(c) for c in code.co_consts
                                      if isinstance(c, CodeType)))


def test_every_read_is_checked_here() -> None:
    assert sorted(WHERES) == sorted(CALLS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_dcp_still_has_the_locals_read_from_its_frame(name: str) -> None:
    where = WHERES[name]
    assert _missing(where) == [], f"torch's DCP changed under dcp_frames.{name}"
    code = dcp_code(where.function)
    assert code is not None and CALLS[name] in _calls(code), \
        f"{where.function} no longer calls {CALLS[name]}: dcp_frames.{name} finds no frame"


def test_a_renamed_local_or_function_is_caught() -> None:
    assert _missing(Where("state_dict_saver.async_save", ("process_group", "pg_renamed"))) \
        == ["pg_renamed"]
    assert _missing(Where("state_dict_loader._load_state_dict.gone", ("planner",))) \
        == ["planner"]


def test_dcp_calls_the_writer_from_its_own_directory() -> None:
    """The outermost DCP frame (``dcp_entry``) is told by DCP's directory: the save that calls
    a StorageWriter is there."""
    save = dcp_code("state_dict_saver._save_state_dict")
    assert save is not None and save.co_filename.startswith(DCP_DIR)
    assert {"set_up_storage_writer", "write_data", "finish"} <= _calls(save)


def test_no_dcp_frame_reads_nothing() -> None:
    assert dcp_locals(dcp_frames.ASYNC_SAVE) is None
