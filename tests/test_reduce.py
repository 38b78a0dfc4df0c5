"""The ordered reduction (``resilience/runtime/reduce.py``) on real gloo ranks: the same bits as the all-gather summed in rank
order it replaced (so no final hash moves), the same bits for any bucket layout, and 2(W-1)/W of the bytes."""

from __future__ import annotations

import pytest

from resilience.bench.reduction import WAYS, measure

NOW, BEFORE = list(WAYS)[2], list(WAYS)[1]


@pytest.mark.timeout(120)
def test_reduce_scatter_keeps_the_bits_and_cuts_the_bytes_on_four_ranks():
    numel = 10_003  # not a multiple of 4: the shards are padded
    rows = measure(4, numel, repeats=1, timeout_s=90)
    assert sorted(rows) == [0, 1, 2, 3]
    for row in rows.values():
        assert row["same bits"] and row["layout-free"]
        bucket = numel * 4
        assert 1.5 * bucket <= row[NOW][0] < 1.5 * bucket + 4096  # padding and gloo's headers: a few bytes
        assert 3.0 * bucket <= row[BEFORE][0] < 3.0 * bucket + 4096
