"""Host memory is pinned in pieces cut at multiples of PIN_PIECE (one cudaHostRegister call
holds the driver's lock for its whole run); a copy may not span two registrations, so copies
are cut at the same bounds. The cutting is plain arithmetic, checked here without a GPU."""

from __future__ import annotations

import pytest

from dcp_datastates._cuda.cuda_copy import PIN_PIECE, _pieces


@pytest.mark.parametrize("addr, nbytes", [
    (0, 0), (4096, 100), (PIN_PIECE - 4096, 8192), (PIN_PIECE, PIN_PIECE),
    (12345 * 4096, 5 * PIN_PIECE + 777), (PIN_PIECE - 1, 2)])
def test_pieces_cover_the_range_and_cut_only_at_multiples(addr: int, nbytes: int) -> None:
    pieces = _pieces(addr, nbytes)
    assert sum(n for _, n in pieces) == nbytes
    at = addr
    for start, n in pieces:
        assert start == at and n > 0
        assert start // PIN_PIECE == (start + n - 1) // PIN_PIECE  # within one piece
        at += n
    assert len(pieces) == (0 if nbytes == 0 else
                           (addr + nbytes - 1) // PIN_PIECE - addr // PIN_PIECE + 1)
