import pytest

from miles_plugins.optimizers.streaming.layout import ALIGN_BYTES, bucket_layout, store_relative_dir
from miles_plugins.optimizers.streaming.plan import SPLIT_ALIGN_NUMEL, Piece, plan_buckets


def covered(buckets, n_entries):
    ranges = {}
    for b in buckets:
        for p in b.pieces:
            ranges.setdefault(p.entry, []).append((p.start, p.stop))
    return {e: sorted(r) for e, r in ranges.items()}


def test_small_entries_pack_in_order_without_splitting():
    buckets = plan_buckets([3, 4, 5, 2], bucket_numel=8)
    assert [b.pieces for b in buckets] == [
        (Piece(0, 0, 3), Piece(1, 0, 4)), (Piece(2, 0, 5), Piece(3, 0, 2))]


def test_large_entry_is_split_at_aligned_points_and_fully_covered():
    budget = 3 * SPLIT_ALIGN_NUMEL + 100
    sizes = [10, 10 * SPLIT_ALIGN_NUMEL + 7, 5]
    buckets = plan_buckets(sizes, bucket_numel=budget)
    assert all(b.numel <= budget for b in buckets)
    pieces = covered(buckets, len(sizes))
    big = pieces[1]
    assert big[0][0] == 0 and big[-1][1] == sizes[1]
    assert all(a[1] == b[0] for a, b in zip(big, big[1:]))
    assert all(start % SPLIT_ALIGN_NUMEL == 0 for start, _ in big)
    assert pieces[0] == [(0, 10)] and pieces[2] == [(0, 5)]


def test_budget_smaller_than_alignment_still_splits():
    buckets = plan_buckets([25], bucket_numel=10)
    assert [b.numel for b in buckets] == [10, 10, 5]


def test_empty_entries_are_skipped_and_bad_budget_rejected():
    assert plan_buckets([0, 0]) == []
    with pytest.raises(ValueError, match="bucket_numel must be positive, got 0"):
        plan_buckets([1], bucket_numel=0)
    with pytest.raises(ValueError, match="entry sizes must be >= 0"):
        plan_buckets([-1])


def test_layout_aligns_every_segment():
    layout = bucket_layout([("main", 4 * 1001), ("exp_avg", 2 * 1001), ("exp_avg_sq", 2 * 1001)])
    offsets = [s.offset for s in layout.segments.values()]
    assert offsets == [0, 4096, 8192] and all(o % ALIGN_BYTES == 0 for o in offsets)
    assert layout.file_bytes == 12288


def test_directory_identity_spelling():
    assert store_relative_dir(3, 0, 12) == "rank00003/opt0_12"  # instance 0, part 12 of a chain
