"""HybridCacheManager: one facade over the two cache kinds a K3 request holds (pure Python).

  MLA layers -> paged latent blocks (grow with the sequence)   [BlockPool]
  KDA layers -> one fixed-size state slot per request           [StatePool]
  prefix caching -> hashed full blocks + KDA checkpoints        [BlockPool.cached, CheckpointStore]

The two pools are sized apart (see `sizing.plan_cache`), unlike vLLM's single page size that
inflates K3 attention blocks to 1,536 tokens (serving-notes.md §2.1). A prefix hit needs both
kinds: the cached latent blocks of the prefix *and* a KDA checkpoint at its end; the usable hit
is the longest prefix with both (SGLang MambaRadixCache: deepest node that owns a state).
With tiers attached (`attach_tiers`: host memory and a directory, cache/tiers.py) a hit may
run past the device: blocks and the state found there are loaded into fresh blocks and the
request's own slot before its prefill (`PrefixHit.loads` / `load_state`), and a longer hit
waiting on the disk makes the request wait a step (`pending`) while k3serve/offload reads it.
Answers are plain ints and lists; the device tensors live in the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

from k3serve.cache.draft_slots import DraftSlots
from k3serve.cache.block_pool import BlockPool, CacheAccountingError
from k3serve.cache.prefix_cache import CheckpointStore, block_hashes
from k3serve.cache.state_pool import StatePool
from k3serve.cache.tiers import Key, TierIndex


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int = 0  # tokens whose latent rows and KDA state are restored
    blocks: tuple[int, ...] = ()  # cached blocks covering them (shared, read-only)
    checkpoint: bytes | None = None  # key of the KDA checkpoint at num_tokens
    junction: int = 0  # tokens of the longest cached block prefix (where this request diverges)
    loads: tuple[bytes, ...] = ()  # hashes of the blocks after `blocks` that come from host memory
    load_state: bytes | None = None  # key of the KDA state that comes from host memory (no checkpoint)
    pending: bool = False  # a longer hit is being read from disk: wait for it


@dataclass(frozen=True)
class CacheAllocation:
    state_slot: int
    blocks: list[int]
    restore_from: int | None = None  # checkpoint slot to copy into state_slot before computing
    loads: tuple[tuple[bytes, int], ...] = ()  # (block hash, block) to fill from host memory first
    load_state: bytes | None = None  # the state key to fill state_slot with from host memory


@dataclass(frozen=True)
class CacheUsage:
    """Bytes one request holds: its state slot, latent rows in use, latent blocks reserved."""

    state_bytes: int
    latent_bytes_used: int
    latent_bytes_reserved: int


class HybridCacheManager:
    def __init__(
        self,
        num_blocks: int,
        num_slots: int,
        block_size: int,
        slot_bytes: int = 0,
        token_bytes: int = 0,
        enable_prefix_caching: bool = False,
        num_checkpoints: int = 0,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = StatePool(num_slots)
        self.slot_bytes, self.token_bytes = slot_bytes, token_bytes
        self.prefix_caching = enable_prefix_caching
        # checkpoint slots follow the live slots in the runner's state tensors
        self.checkpoints = CheckpointStore(list(range(num_slots, num_slots + num_checkpoints)))
        self._tables: dict[str, list[int]] = {}
        self._slot_of: dict[str, int] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._registered: dict[str, int] = {}
        self.tiers: TierIndex | None = None
        self._prefetch: Callable[[list[Key]], None] | None = None
        self._fresh_blocks: list[tuple[bytes, int]] = []  # published since the last drain_fresh
        self._fresh_states: list[tuple[bytes, int]] = []
        self.drafts: DraftSlots | None = None  # slot-per-draft rows (cache/draft_slots.py), or None
        self.write_back = False  # the tiers take what the pools evict (attach_tiers)

    def use_draft_slots(self, drafts: DraftSlots) -> None:
        """Give every state slot a row of 1 + k physical slots (the graph backend's verify steps)."""
        if self._slot_of:
            raise CacheAccountingError("draft slots must be set before any request holds a slot")
        self.drafts = drafts

    def attach_tiers(self, index: TierIndex, prefetch: Callable[[list[Key]], None], write_back: bool = False) -> None:
        """Host/disk tiers (k3serve/offload): lookups run on into them, and what the pools
        publish is collected for them (drain_fresh); `prefetch` asks for disk entries.
        `write_back`: collect what the pools evict instead (drain_evicted), not what they publish."""
        self.tiers, self._prefetch = index, prefetch
        self.write_back = write_back
        if write_back:
            self.blocks.evicted, self.checkpoints.evicted = [], []

    def resident(self) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
        """Every published block (hash, block) and valid checkpoint (key, slot) the pools hold."""
        return list(self.blocks.cached.items()), self.checkpoints.valid()

    def drain_evicted(self) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
        """Blocks (hash, block) and checkpoints (key, slot) the pools reclaimed since the last
        call (write-back): their rows still hold the entries until the step that reuses them."""
        if not self.write_back:
            return [], []
        out = self.blocks.evicted, self.checkpoints.evicted
        self.blocks.evicted, self.checkpoints.evicted = [], []
        return out

    def drain_fresh(self) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
        """Blocks (hash, block) and checkpoints (key, slot) published since the last call."""
        out = self._fresh_blocks, self._fresh_states
        self._fresh_blocks, self._fresh_states = [], []
        return out

    # ---- queries ---------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_admit(self, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """A new request needing rows [0, num_tokens) fits: one slot and enough blocks."""
        shared = len(hit.blocks) if hit else 0
        parked = sum(1 for b in (hit.blocks if hit else ()) if self.blocks.ref_count(b) == 0)
        need = self.blocks_for(num_tokens) - shared
        return self.slots.num_free > 0 and need <= self.blocks.num_free - parked

    def can_append(self, req_id: str, num_tokens: int) -> bool:
        return self._missing(req_id, num_tokens) <= self.blocks.num_free

    def holds(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def block_table(self, req_id: str) -> list[int]:
        return list(self._tables[req_id])

    def state_slot(self, req_id: str) -> int:
        """The physical state slot holding the request's KDA state now."""
        g = self._slot_of[req_id]
        return g if self.drafts is None else self.drafts.live(g)

    def draft_row(self, req_id: str) -> list[int] | None:
        """The 1 + k slots a verify pass of the request writes positions 0..k to, or None."""
        return None if self.drafts is None else self.drafts.row(self._slot_of[req_id])

    def accept_draft(self, req_id: str, position: int) -> None:
        """A static verify pass accepted `position`: its slot becomes the live one (no copy)."""
        if self.drafts is not None and req_id in self._slot_of:
            self.drafts.accept(self._slot_of[req_id], position)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def num_requests(self) -> int:
        return len(self._slot_of)

    def usage(self, req_id: str, num_tokens: int) -> CacheUsage:
        return CacheUsage(
            self.slot_bytes,
            num_tokens * self.token_bytes,
            len(self._tables[req_id]) * self.block_size * self.token_bytes,
        )

    # ---- prefix caching --------------------------------------------------------------------
    def lookup(self, token_ids: list[int]) -> PrefixHit:
        """Longest prefix with cached blocks and a valid checkpoint, leaving >= 1 token to compute."""
        if not self.prefix_caching:
            return PrefixHit()
        bs, hashes = self.block_size, block_hashes(token_ids, self.block_size)
        cached = self._cached_run(hashes)
        if self.tiers is not None:
            return self._tier_lookup(token_ids, hashes, cached)
        for k in range(cached, 0, -1):
            if k * bs < len(token_ids) and self.checkpoints.get(hashes[k - 1]) is not None:
                blocks = tuple(self.blocks.cached[h] for h in hashes[:k])
                return PrefixHit(k * bs, blocks, hashes[k - 1], cached * bs)
        return PrefixHit(junction=cached * bs)

    def _tier_lookup(self, token_ids: list[int], hashes: list[bytes], cached: int) -> PrefixHit:
        """The longest k whose blocks are each on the device or in a tier and whose state is a
        device checkpoint or in a tier. Usable now: everything on the device or in host memory;
        a longer one needing the disk is prefetched and the hit says `pending`."""
        bs, tiers = self.block_size, self.tiers
        where = []  # tier of each block after the device run
        while cached + len(where) < len(hashes) and (w := tiers.where(("block", hashes[cached + len(where)]))):
            where.append(w)
        if cached < len(hashes):  # the device run ended short: the tiers are asked
            tiers.stats["cpu"].queries += 1
            if "disk" in where:
                tiers.stats["disk"].queries += 1
        now = later = 0
        for k in range(cached + len(where), 0, -1):
            if k * bs >= len(token_ids):
                continue
            key = hashes[k - 1]
            state = "dev" if self.checkpoints.get(key) is not None else tiers.where(("state", key))
            if state is None:
                continue
            on_disk = state == "disk" or "disk" in where[: max(0, k - cached)]
            if not on_disk:
                now = max(now, k)
                break
            later = max(later, k)
        if later > now:
            need = [("block", h) for h, w in zip(hashes[cached:later], where) if w == "disk"]
            if tiers.where(("state", hashes[later - 1])) == "disk" and self.checkpoints.get(hashes[later - 1]) is None:
                need.append(("state", hashes[later - 1]))
            self._prefetch(need)
        junction = (cached + len(where)) * bs
        if now == 0:
            return PrefixHit(junction=junction, pending=later > now)
        key = hashes[now - 1]
        device_state = self.checkpoints.get(key) is not None
        return PrefixHit(
            now * bs,
            tuple(self.blocks.cached[h] for h in hashes[: min(now, cached)]),
            key if device_state else None,
            junction,
            tuple(hashes[cached:now]),
            None if device_state else key,
            pending=later > now,
        )

    def held_prefix(self, token_ids: list[int]) -> tuple[int, ...]:
        """Cached blocks of the longest block prefix of `token_ids` (no KDA checkpoint needed):
        the latent rows a prefill/decode hand-off need not send (engine/handoff.py)."""
        if not self.prefix_caching:
            return ()
        hashes = block_hashes(token_ids, self.block_size)
        return tuple(self.blocks.cached[h] for h in hashes[: self._cached_run(hashes)])

    def reusable_tokens(self, token_ids: list[int]) -> int:
        """Tokens of the longest block prefix of `token_ids` cached on the device or in a tier
        (host memory, disk): what a replica could reuse, for routing (no KDA state asked: the
        lookup at admission decides the exact hit)."""
        if not self.prefix_caching:
            return 0
        hashes = block_hashes(token_ids, self.block_size)
        n = self._cached_run(hashes)
        while self.tiers is not None and n < len(hashes) and self.tiers.where(("block", hashes[n])):
            n += 1
        return n * self.block_size

    def _cached_run(self, hashes: list[bytes]) -> int:
        """How many leading block hashes have a cached block."""
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks.cached:
            n += 1
        return n

    def save_points(self, prompt_len: int, hit: PrefixHit, interval: int = 0) -> list[int]:
        """Where a request's prefill should leave KDA checkpoints (prefix caching's policy; none
        without it): the end of the prompt's last full block, the junction where it left the
        cached prefix `hit`, and every `interval` tokens (multiples of the block size)."""
        if not self.prefix_caching:
            return []
        bs, start = self.block_size, hit.num_tokens
        prompt_end = prompt_len // bs * bs
        points = {prompt_end, hit.junction}
        if interval:
            points.update(range(interval, prompt_end + 1, interval))
        return sorted(p for p in points if start < p <= prompt_end and p % bs == 0)

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        """A prompt's lookup for the hit-rate counters (prefix caching on)."""
        if not self.prefix_caching:
            return
        st = self.checkpoints.stats
        st.queries, st.query_tokens, st.hit_tokens = (
            st.queries + 1,
            st.query_tokens + query_tokens,
            st.hit_tokens + hit_tokens,
        )

    def checkpoint_key(self, req_id: str, token_ids: list[int], position: int) -> bytes:
        """Hash of the block ending at `position` (a multiple of block_size)."""
        return self._hashes_upto(req_id, token_ids, position // self.block_size)[position // self.block_size - 1]

    def begin_checkpoint(self, key: bytes) -> int | None:
        return self.checkpoints.begin(key)

    def end_step(self, pinned: list[bytes]) -> None:
        """After a step ran: checkpoints written in it become valid; restores from it unpin."""
        committed = self.checkpoints.commit()
        if self.tiers is not None and not self.write_back:
            self._fresh_states += committed
        for key in pinned:
            self.checkpoints.unpin(key)

    def abandon_step(self, pinned: list[bytes]) -> None:
        """A step raised before it finished: its checkpoints were never fully written."""
        self.checkpoints.discard_pending()
        for key in pinned:
            self.checkpoints.unpin(key)

    def completes_block(self, req_id: str, num_computed: int) -> bool:
        """Whether register_computed would publish a block (callers skip building token lists)."""
        return self.prefix_caching and num_computed // self.block_size > self._registered.get(req_id, 0)

    def register_computed(self, req_id: str, token_ids: list[int], num_computed: int) -> None:
        """Publish the request's blocks that are now fully computed."""
        if not self.completes_block(req_id, num_computed):
            return
        full = num_computed // self.block_size
        done = self._registered.get(req_id, 0)
        hashes = self._hashes_upto(req_id, token_ids, full)
        table = self._tables[req_id]
        for i in range(done, full):
            self.blocks.register(table[i], hashes[i])
            if self.tiers is not None and not self.write_back:
                self._fresh_blocks.append((hashes[i], table[i]))
        self._registered[req_id] = full

    def flush(self) -> tuple[int, int]:
        """Reset the prefix cache: drop cached-free blocks and unpinned checkpoints."""
        return self.blocks.flush(), self.checkpoints.flush()

    # ---- changes ---------------------------------------------------------------------
    def allocate(self, req_id: str, num_tokens: int, hit: PrefixHit | None = None) -> CacheAllocation:
        if req_id in self._slot_of:
            raise CacheAccountingError(f"request {req_id!r} already holds cache")
        if not self.can_admit(num_tokens, hit):
            raise CacheAccountingError(f"request {req_id!r} does not fit ({num_tokens} tokens)")
        slot = self.slots.allocate()
        restore = None
        shared = list(hit.blocks) if hit else []
        if shared:
            self.blocks.share(shared)
            self._registered[req_id] = len(shared)
        # a hand-off brings its own KDA state: shared blocks without a checkpoint (held_prefix)
        if hit is not None and hit.checkpoint is not None:
            restore = self.checkpoints.pin(hit.checkpoint)
        blocks = shared + self.blocks.allocate(self.blocks_for(num_tokens) - len(shared))
        self._slot_of[req_id], self._tables[req_id] = slot, blocks
        # tier blocks fill the fresh blocks after the shared ones; they are published (and so
        # shared) once the step that loads them has run, as computed blocks are
        loads = tuple(zip(hit.loads, blocks[len(shared) :])) if hit is not None else ()
        if self.tiers is not None and hit is not None and (loads or hit.load_state is not None):
            self.tiers.stats["cpu"].hit_tokens += hit.num_tokens
        live = self.state_slot(req_id)
        return CacheAllocation(live, list(blocks), restore, loads, hit.load_state if hit is not None else None)

    def append(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` rows; the new blocks, or None if they
        do not fit (then nothing changes and the caller preempts someone)."""
        missing = self._missing(req_id, num_tokens)
        if missing > self.blocks.num_free:
            return None
        new = self.blocks.allocate(missing)
        self._tables[req_id].extend(new)
        return new

    def free(self, req_id: str) -> None:
        if req_id not in self._slot_of:
            raise CacheAccountingError(f"request {req_id!r} holds no cache")
        self.blocks.free(self._tables.pop(req_id))
        self.slots.free(self._slot_of.pop(req_id))
        self._hashes.pop(req_id, None)
        self._registered.pop(req_id, None)

    def _missing(self, req_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables[req_id]))

    def _hashes_upto(self, req_id: str, token_ids: list[int], n_blocks: int) -> list[bytes]:
        have = self._hashes.setdefault(req_id, [])
        if len(have) < n_blocks:
            parent = have[-1] if have else None
            have += block_hashes(
                token_ids[: n_blocks * self.block_size], self.block_size, start=len(have), parent=parent
            )
        return have
