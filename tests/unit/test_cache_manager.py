"""Pure-Python cache bookkeeping: pools, HybridCacheManager, sizing split (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3serve.cache.block_pool import BlockPool, CacheAccountingError
from k3serve.cache.manager import HybridCacheManager
from k3serve.cache.sizing import kda_state_bytes_per_request, parse_bytes, plan_cache
from k3serve.cache.state_pool import StatePool
from k3serve.config.bundled import load_model_config


def test_bookkeeping_modules_never_import_torch():
    code = (
        "import sys; import k3serve, k3serve.cache.manager, k3serve.cache.sizing, "
        "k3serve.scheduler.scheduler, k3serve.sampling_params; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_pool_refcounts_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_count(b) == 1 for b in a)
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1  # still shared by the second owner
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(CacheAccountingError, match="freed twice"):
        pool.free(a[:1])
    with pytest.raises(CacheAccountingError):
        pool.allocate(5)
    assert pool.num_free == 4  # all-or-nothing


def test_state_pool_reuses_slots_and_rejects_double_free():
    pool = StatePool(2)
    s0, s1 = pool.allocate(), pool.allocate()
    assert {s0, s1} == {0, 1} and pool.num_free == 0
    with pytest.raises(CacheAccountingError):
        pool.allocate()
    pool.free(s0)
    assert pool.allocate() == s0
    pool.free(s1)
    with pytest.raises(CacheAccountingError, match="twice"):
        pool.free(s1)


def test_manager_admit_append_free_back_to_zero():
    m = HybridCacheManager(num_blocks=5, num_slots=2, block_size=4)
    assert m.can_admit(20) and not m.can_admit(21)
    a = m.allocate("a", 5)  # 2 blocks
    assert len(a.blocks) == 2 and m.block_table("a") == a.blocks
    assert m.append("a", 8) == []  # still inside block 2
    assert len(m.append("a", 9)) == 1
    m.allocate("b", 4)
    assert not m.can_admit(1)  # no slot left even though a block is free
    assert m.append("b", 9) is None and len(m.block_table("b")) == 1  # needs 2, 1 free: unchanged
    m.free("a")
    m.free("b")
    assert (m.num_free_blocks, m.num_free_slots, m.num_requests) == (5, 2, 0)
    with pytest.raises(CacheAccountingError):
        m.free("a")


def test_k3_state_bytes_constant_and_latent_bytes_per_token():
    """Issue 4: 1k- and 16k-token requests hold the same KDA state bytes; latent bytes grow by
    576 x n_mla_layers x dtype bytes per token."""
    cfg = load_model_config("moonshotai/Kimi-K3")
    plan = plan_cache(cfg, 200 * 2**30, max_model_len=32768, max_num_seqs=8, kv_dtype="bfloat16")
    m = HybridCacheManager(plan.num_blocks, plan.num_slots, plan.block_size, plan.slot_bytes, plan.token_bytes)
    m.allocate("short", 1024)
    m.allocate("long", 16384)
    short, long = m.usage("short", 1024), m.usage("long", 16384)
    assert short.state_bytes == long.state_bytes == kda_state_bytes_per_request(cfg) == 464_633_856
    per_token = 576 * 24 * 2
    assert cfg.mla.cache_dim == 576 and len(cfg.mla_layers) == 24
    assert long.latent_bytes_used - short.latent_bytes_used == (16384 - 1024) * per_token
    m.append("short", 1025)
    assert m.usage("short", 1025).latent_bytes_used - short.latent_bytes_used == per_token
    assert m.usage("short", 1025).latent_bytes_reserved == 65 * 16 * per_token  # whole blocks


def test_plan_cache_split_and_errors():
    cfg = load_model_config("moonshotai/Kimi-K3")
    plan = plan_cache(cfg, 100 * 2**30, max_model_len=131072, max_num_seqs=64)
    per_req = plan.slot_bytes + 131072 // 16 * plan.block_bytes
    assert plan.num_slots == 100 * 2**30 // per_req
    assert plan.max_concurrency(131072) == plan.num_slots  # slots sized for full-length requests
    assert plan.total_bytes <= 100 * 2**30 < plan.total_bytes + plan.block_bytes
    capped = plan_cache(cfg, 100 * 2**30, max_model_len=4096, max_num_seqs=8)
    assert capped.num_slots == 8 and capped.max_concurrency(4096) == 8
    assert capped.kv_tokens > 8 * 4096  # spare bytes all go to latent blocks
    fixed = plan_cache(cfg, 100 * 2**30, max_model_len=4096, max_num_seqs=8, num_slots=100)
    assert fixed.num_slots == 100
    with pytest.raises(ValueError, match="cannot hold one request"):
        plan_cache(cfg, 2**30, max_model_len=131072, max_num_seqs=1)
    with pytest.raises(ValueError, match="leave no room"):
        plan_cache(cfg, 10 * 2**30, max_model_len=4096, max_num_seqs=8, num_slots=1000)


@pytest.mark.parametrize(
    "text, want",
    [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1073741824", 2**30), ("1.5 GiB", 3 * 2**29)],
)
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_cached_blocks_park_in_lru_and_are_evicted_oldest_first():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.register(a, b"ha") and pool.register(b, b"hb") and not pool.register(a, b"other")
    pool.free([a])
    pool.free([b])
    assert pool.num_free == 3 and pool.num_cached_free == 2 and pool.cached == {b"ha": a, b"hb": b}
    pool.share([b])  # a hit brings b back into use
    assert pool.num_cached_free == 1 and pool.ref_count(b) == 1
    got = pool.allocate(2)  # the never-used block first, then evict the LRU cached one (a)
    assert a in got and b"ha" not in pool.cached and pool.num_evicted == 1
    plain = next(x for x in got if x != a)
    pool.free([plain])  # never registered: back to the plain free list, not shareable
    with pytest.raises(CacheAccountingError, match="cannot be shared"):
        pool.share([plain])


def test_checkpoint_store_pending_pins_and_lru():
    from k3serve.cache.prefix_cache import CheckpointStore

    store = CheckpointStore([10, 11])
    s1 = store.begin(b"k1")
    assert s1 in (10, 11) and store.get(b"k1") is None  # pending until the step ran
    assert store.begin(b"k1") is None  # no duplicate writes
    store.commit()
    assert store.get(b"k1") == s1
    store.begin(b"k2")
    store.commit()
    store.pin(b"k1")  # in use this step: never evicted; k2 becomes the victim
    s3 = store.begin(b"k3")
    store.commit()
    assert store.get(b"k2") is None and store.get(b"k1") == s1 and s3 not in (None, s1)
    assert store.begin(b"k4") is None or store.get(b"k1") == s1
    store.unpin(b"k1")
    with pytest.raises(CacheAccountingError):
        store.unpin(b"k1")


def test_lookup_needs_blocks_and_checkpoint_and_leaves_one_token():
    m = HybridCacheManager(num_blocks=16, num_slots=2, block_size=4, enable_prefix_caching=True, num_checkpoints=2)
    toks = list(range(1, 13))  # 3 full blocks
    assert m.lookup(toks).num_tokens == 0
    m.allocate("a", 12)
    m.register_computed("a", toks, 12)
    assert m.lookup(toks + [99]).junction == 12 and m.lookup(toks + [99]).num_tokens == 0  # no state yet
    m.begin_checkpoint(m.checkpoint_key("a", toks, 8))
    m.begin_checkpoint(m.checkpoint_key("a", toks, 12))
    m.end_step([])
    assert m.lookup(toks + [99]).num_tokens == 12
    assert m.lookup(toks).num_tokens == 8  # identical prompt: one token must be recomputed
    assert m.lookup([1, 2, 3, 4, 7, 7, 7, 7, 9]).num_tokens == 0  # diverges inside block 2: no state at 4
    m.free("a")
    assert m.num_free_blocks == 16 and m.blocks.num_cached_free == 3
    assert m.flush() == (3, 2) and m.lookup(toks + [99]).num_tokens == 0
