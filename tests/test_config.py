"""Config facts read from the format registry, and the one integer check."""

from __future__ import annotations

import pytest

from kvslim.checks import check_int
from kvslim.config import MEAN_CENTER_FORMATS, CacheConfig
from kvslim.formats import format_names, get_format


def test_mean_center_formats_come_from_the_registry():
    assert MEAN_CENTER_FORMATS == ("q4_0", "q5_0", "q8_0")
    assert set(MEAN_CENTER_FORMATS) == {n for n in format_names() if get_format(n).mean_center}
    for name in MEAN_CENTER_FORMATS:
        assert CacheConfig(kv_quantize="int4", k_quantize=name, mean_center="b.gguf").k_format == name


@pytest.mark.parametrize(
    "fmt,why",
    [
        ("int4", "its zero point already absorbs a per-channel mean"),
        ("q5_1", "its zero point already absorbs a per-channel mean"),
        ("fp8", "it does not quantize K with a symmetric (zero-point free) block format"),
        ("none", "it does not quantize K with a symmetric (zero-point free) block format"),
    ],
)
def test_mean_center_refusal_names_the_reason(fmt, why):
    with pytest.raises(ValueError) as e:
        CacheConfig(kv_quantize=fmt, mean_center="b.gguf")
    assert str(e.value) == (
        f"mean_center does not apply to K format {fmt!r}: {why}; it applies to q4_0, q5_0, q8_0"
    )


def test_check_int_messages():
    assert check_int("n", 3, minimum=1) == 3
    with pytest.raises(ValueError, match=r"^window must be >= 1 or None for an unbounded cache, got 0$"):
        check_int("window", 0, minimum=1, hint="or None for an unbounded cache")
    with pytest.raises(ValueError, match=r"^sink must be an integer >= 0, got True$"):
        check_int("sink", True, minimum=0)  # a bool is not an integer here
    with pytest.raises(ValueError, match=r"^sink must be an integer >= 0, got 2.0$"):
        check_int("sink", 2.0, minimum=0)
    with pytest.raises(ValueError, match=r"^offset must be an integer in \[0, 8\), got 8$"):
        check_int("offset", 8, minimum=0, below=8)
    with pytest.raises(ValueError, match=r"^group_size must be a positive integer, got 0$"):
        check_int("group_size", 0, minimum=1, expected="a positive integer")
    assert check_int("offset", 7, minimum=0, below=8) == 7
