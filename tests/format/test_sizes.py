"""Byte sizes as people write them (``parse_size``: ``"16GiB"``, ``"512 MiB"``, plain ints)."""

from __future__ import annotations

import pytest

from dcp_datastates import parse_size


# -- sizes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "nbytes"),
    [(4096, 4096), ("4096", 4096), ("16GiB", 16 << 30), ("512 MiB", 512 << 20),
     ("1.5KiB", 1536), ("2gb", 2 * 10**9), ("7B", 7), ("0", 0)],
)
def test_parse_size(text, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["12 parsecs", "GiB", "1e3", "-5", "1.2.3MiB", ""])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=rf"cache={text!r} is not a size"):
        parse_size(text, name="cache")


def test_parse_size_rejects_negative_and_bool() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        parse_size(-1)
    with pytest.raises(TypeError, match="must be an int or a string"):
        parse_size(True)
