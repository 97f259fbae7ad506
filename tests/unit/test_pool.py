import pytest

from orchestrator.transfer.pool import BlockPool, DoubleFreeError

KIB = 1024


def test_rounds_up_to_whole_blocks_and_packs_first_fit():
    pool = BlockPool(16 * KIB, 4 * KIB)
    assert pool.alloc(1) == 0
    assert pool.alloc(4 * KIB + 1) == 4 * KIB  # two blocks
    assert pool.alloc(4 * KIB) == 12 * KIB
    assert pool.usage().bytes_free == 0


def test_full_returns_none_and_free_makes_room():
    pool = BlockPool(8 * KIB, 4 * KIB)
    a = pool.alloc(8 * KIB)
    assert pool.alloc(1) is None
    assert pool.free(a) == 8 * KIB
    assert pool.alloc(1) == 0


def test_fragmentation_and_coalescing():
    pool = BlockPool(40 * KIB, 4 * KIB)
    offs = [pool.alloc(8 * KIB) for _ in range(5)]
    assert offs == [0, 8 * KIB, 16 * KIB, 24 * KIB, 32 * KIB]
    pool.free(offs[1])
    pool.free(offs[3])
    usage = pool.usage()
    assert (usage.bytes_free, usage.largest_free, usage.allocations) == (16 * KIB, 8 * KIB, 3)
    assert pool.alloc(12 * KIB) is None  # enough bytes free, but no run that long
    assert pool.alloc(4 * KIB) == 8 * KIB  # first fit takes the first hole
    pool.free(offs[2])  # merges with the tail of hole 1 and with hole 3
    assert pool.usage().largest_free == 4 * KIB + 8 * KIB + 8 * KIB
    assert pool.alloc(20 * KIB) == 12 * KIB
    for off in (0, 8 * KIB, 12 * KIB, 32 * KIB):
        pool.free(off)
    usage = pool.usage()
    assert (usage.allocations, usage.bytes_in_use, usage.largest_free) == (0, 0, 40 * KIB)


def test_double_free_and_bad_offsets_raise():
    pool = BlockPool(16 * KIB, 4 * KIB)
    off = pool.alloc(8 * KIB)
    pool.free(off)
    with pytest.raises(DoubleFreeError):
        pool.free(off)
    pool.alloc(8 * KIB)
    with pytest.raises(DoubleFreeError):
        pool.free(4 * KIB)  # inside a run, not its start
    with pytest.raises(DoubleFreeError):
        pool.free(1)


def test_partial_trailing_block_is_unused():
    pool = BlockPool(10 * KIB, 4 * KIB)
    assert pool.total_bytes == 8 * KIB
    assert pool.alloc(9 * KIB) is None


def test_rejects_bad_geometry():
    with pytest.raises(ValueError):
        BlockPool(1 * KIB, 4 * KIB)
    with pytest.raises(ValueError):
        BlockPool(16 * KIB, 0)
