import pytest

from trajserve.kv.block_pool import BlockPool, NoFreeBlocks
from trajserve.kv.block_table import BlockTable
from trajserve.kv.cache_manager import KVCacheManager


def test_allocate_free_roundtrip():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 3
    pool.check()
    pool.free(b)
    assert pool.num_free == 8
    pool.check()


def test_refcount_shared_block_freed_by_last_holder():
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.incref([blk])
    pool.free([blk])
    assert pool.ref_counts[blk] == 1 and pool.num_free == 3
    pool.free([blk])
    assert pool.ref_counts[blk] == 0 and pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.free([blk])  # double free is caught
    with pytest.raises(AssertionError):
        pool.incref([blk])  # cannot share a free block


def test_block_table_slots():
    t = BlockTable(4)
    t.block_ids = [7, 2, 5]
    assert t.slots(0, 12).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert t.slots(5, 7).tolist() == [9, 10]
    assert t.blocks_needed(12) == 0 and t.blocks_needed(13) == 1


def test_cache_manager_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16, watermark=0.0)
    assert kv.allocate_slots("a", 40)  # 3 blocks
    assert not kv.allocate_slots("b", 17)  # needs 2, 1 free: nothing taken
    assert kv.pool.num_free == 1 and "b" not in kv.tables
    assert kv.allocate_slots("a", 48)  # still 3 blocks
    assert kv.allocate_slots("a", 49)  # 4th block
    assert kv.usage() == 1.0  # eq. 8
    kv.release("a")
    assert kv.pool.num_free == 4 and kv.usage() == 0.0
    kv.pool.check()


def test_watermark_blocks_admission():
    kv = KVCacheManager(num_blocks=100, block_size=16, watermark=0.1)
    assert kv.can_admit("a", 90 * 16)
    assert not kv.can_admit("a", 91 * 16)
