"""PrefixTiers: the prefix cache's host-memory and disk tiers for one engine (one rank).

Write-through by default, as vLLM's CPU offloading and LMCache store: after each step the
blocks the pools published and the KDA checkpoints they committed are copied to host memory
(pinned, with non-blocking copies, on a GPU) before the next step can reuse their rows. Write-back
(--kv-offloading-write-policy write_back, SGLang HiCache's name) copies instead what scheduling
just evicted, before the step that reuses those rows (LLMEngine.write_back), and at shutdown
what the pools still hold; a shared directory sees an entry only once it is evicted. A writer thread
persists them to the directory as packs: one file for the blocks a step published (a prefill
chunk's 32 blocks, say), one for each state (offload/entry.py). A pack is read, verified and
evicted whole; the index still holds each block and state under its own key. Host memory and the directory each keep an LRU
under their byte budget (cache/tiers.py); the directory's survives restarts (scanned at start,
oldest first) and may be shared by engines of the same model (same fingerprint). Under calibrated
fp8 scales (--calculate-kv-scales) entries sit in a folder named after the scales they were
written under: engines that calibrated differently share the directory but never read each
other's latents.

Reading: a lookup that needs disk entries asks for them (`prefetch`); reader threads load and
verify them (offload/entry.py) while other requests' steps run, and `poll` (at each step's
start, on the engine thread, which alone changes the index) moves them into host memory or
drops a rejected file with a warning naming it. `load` copies host entries into the device
pools before the step that uses them. Threads do file I/O only.

Shapes: a block entry is `latent.{l}` [block_size, c + r] per MLA layer in the cache dtype; a
state entry `recurrent.{l}` [H, D, D] and `conv.{l}` [K-1, 3P] per KDA layer (this rank's heads).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from k3serve.cache.tiers import Key, TierIndex, TierLRU
from k3serve.offload.entry import EntryError, pack_bytes, pack_index_keys, read_pack, write_pack
from k3serve.offload.ports import ExecutorPort
from k3serve.offload.scales import save_scales, saved_scales, scales_folder

log = logging.getLogger("k3serve.offload")
READERS = 8  # threads reading disk entries
ABSENT_S = 1.0  # how long a key not found in a shared directory is not looked for again


class PrefixTiers:
    def __init__(
        self,
        cache,
        block_size: int,
        cpu_bytes: int,
        disk_dir: str | None,
        disk_bytes: int,
        fingerprint: str,
        executor,
    ):
        """`executor`: the replica's ranks (executor/base.py). Under TP the latent is whole on
        every rank (a block entry is rank 0's rows, written to every rank on load) and each rank
        holds its heads of the KDA state: a state entry holds every rank's shard, `recurrent.{l}`
        rank 0's and `recurrent.{l}.r{r}` rank r's. `cache`: rank 0's cache tensors, or a
        meta-device twin giving the shapes when they live in worker processes (offload/ports.py)."""
        self.bs, self.fingerprint = block_size, fingerprint
        self.mla = [l for l, t in enumerate(cache.latent) if t is not None]
        self.kda = [l for l, t in enumerate(cache.recurrent) if t is not None]
        self.port = ExecutorPort(executor, block_size, self.mla, self.kda)
        n = executor.size
        ranks = [""] + [f".r{r}" for r in range(1, n)]
        self.expect = {
            "block": {f"latent.{l}": ((block_size, cache.latent[l].shape[1]), cache.latent[l].dtype) for l in self.mla},
            "state": {
                **{
                    f"recurrent.{l}{r}": (tuple(cache.recurrent[l].shape[1:]), cache.recurrent[l].dtype)
                    for l in self.kda
                    for r in ranks
                },
                **{
                    f"conv.{l}{r}": (tuple(cache.conv[l].shape[1:]), cache.conv[l].dtype)
                    for l in self.kda
                    for r in ranks
                },
            },
        }
        self.entry_bytes = {
            kind: sum(torch.Size(s).numel() * d.itemsize for s, d in e.values()) for kind, e in self.expect.items()
        }
        self.pin = cache_device(cache).type == "cuda"  # a meta twin's is "meta"
        # calibrated fp8 scales: entries live in a folder of their scales (`_open_scales`), and
        # until this engine's scales are known (its first rows) it neither reads nor writes there
        self.root = Path(disk_dir) / fingerprint if disk_dir else None
        self.dir = self.root if not (self.root and cache.calibrating) else None
        self.index = TierIndex(TierLRU(cpu_bytes), TierLRU(disk_bytes) if self.root else None)
        self.host: dict[Key, dict[str, torch.Tensor]] = {}
        self.file_of: dict[Key, Path] = {}  # disk entries: the pack each is read from
        self.packs: dict[Path, list[Key]] = {}  # every entry a pack holds (its header's keys)
        self._reading: dict[Path, set[Key]] = {}  # packs being read -> the entries waited for
        self._writes: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()  # (op, key, payload) back to the engine thread
        self._arrived = threading.Event()
        self._threads, self._readers = [], None
        self._calibrated = False  # scales calibrated here or adopted: the folder is opened when known
        self._absent: dict[Key, float] = {}  # keys looked for on disk and not found: when (discover)
        self._deleting: set[Path] = set()  # packs dropped, their deletion queued
        self._held: set[Key] = set()  # host entries the scheduled step loads (`hold`)
        self._writing: set = set()  # ("writing", path): the disk budget reserved for packs in flight
        if self.root is not None and cache.calibrating:
            self._calibrated = True
            self._adopt_scales(cache)
        if self.dir is not None:
            self._scan()
            self.index.discover = self.discover
        if self.root is not None:
            # file reads and checksums release the GIL: a prefix of many small blocks reads in parallel
            self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="k3serve-tier-read")
            t = threading.Thread(target=self._write_loop, daemon=True, name="k3serve-tier-writer")
            t.start()
            self._threads.append(t)
        # at close, garbage collection or interpreter exit: queued writes reach the directory
        self._finalizer = weakref.finalize(self, _stop, self._readers, self._writes, self._threads)

    # ---- files -------------------------------------------------------------------------------
    def _adopt_scales(self, cache) -> None:
        """--calculate-kv-scales with a directory: a restarted engine takes the scales saved there
        (the first engine's) instead of calibrating anew, so it reads what that engine wrote.
        None saved yet (or unreadable): this engine calibrates on its first rows."""
        saved = saved_scales(self.root)
        if saved is None:
            return
        cache.use_scales(saved, calibrate=False)
        self.dir = scales_folder(self.root, saved)
        log.info(
            "fp8 latent scales of %d layers from %s (the entries there were written under them)", len(saved), self.root
        )

    def _open_scales(self, cache) -> None:
        """This engine's scales are known (its first rows set them): its entries live in their
        folder (offload/scales.py), and the first saved set is what later engines adopt. A
        directory this engine cannot write to is left alone: the disk tier is off."""
        try:
            self.dir = save_scales(self.root, {i: float(s) for i, s in cache.latent_scale.items()})
        except OSError as e:
            log.warning("prefix cache: the directory %s cannot be written (%s): the disk tier is off", self.root, e)
            self.root, self.index.disk = None, None
            return
        self._scan()
        self.index.discover = self.discover

    def discover(self, key: Key) -> bool:
        """A directory shared with other engines (replicas, a P/D pair): whether a pack named
        `key` has appeared there since the scan; if so it joins the index, every entry it holds.
        Packs are named after their first entry, which is what a prefix walk asks for first
        (a store's blocks run in prefix order). A miss is not asked again for ABSENT_S seconds."""
        now = time.monotonic()
        if now - self._absent.get(key, -ABSENT_S) < ABSENT_S:
            return False
        path = self.pack_path(key)
        if path in self._deleting:
            return False
        try:
            size = path.stat().st_size
        except OSError:
            self._absent[key] = now
            if len(self._absent) > 4096:  # only the last ABSENT_S's misses matter: forget the rest
                self._absent = {k: t for k, t in self._absent.items() if now - t < ABSENT_S}
            return False
        keys = pack_index_keys(path, key[0])
        if key not in keys:
            self._absent[key] = now
            return False
        self._absent.pop(key, None)
        self._index_pack(path, keys, size)
        return key in self.index.disk

    def pack_path(self, key: Key) -> Path:
        """The pack a store starting with `key` writes: named after its first entry."""
        kind, h = key
        return self.dir / kind / h.hex()[:2] / f"{h.hex()}.safetensors"

    def _scan(self) -> None:
        """Index the directory's packs (keys from their headers), oldest first; remove temporary
        files of dead writers. Nothing is trusted until read (read_pack checks it all)."""
        found = []
        for kind in ("block", "state"):
            for p in (self.dir / kind).glob("*/*"):
                if p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)
                elif p.suffix == ".safetensors" and (keys := pack_index_keys(p, kind)):
                    st = p.stat()
                    found.append((st.st_mtime, p, keys, st.st_size))
        for _, path, keys, size in sorted(found, key=lambda f: f[0]):
            self._index_pack(path, keys, size)
        if found:
            log.info(
                "prefix cache directory %s: %d packs, %.1f MiB", self.dir, len(found), self.index.disk.used / 2**20
            )

    def _index_pack(self, path: Path, keys: list[Key], size: int) -> None:
        """A pack on disk joins the index, each entry with its share of the bytes (an entry some
        other pack already holds stays with that one); packs the budget then evicts leave whole."""
        if path in self.packs:  # rewritten: its old entries go first
            self._drop_pack(path, delete=False)
        self.packs[path] = keys
        evicted = []
        for key in keys:
            if key not in self.file_of:
                self.file_of[key] = path
                evicted += self.index.disk.add(key, max(1, size // len(keys)), self._writing)
        self._evicted(evicted)

    def _evicted(self, keys: list) -> None:
        for old in keys:
            self.index.stats["disk"].evictions += 1
            if old in self.file_of:
                self._drop_pack(self.file_of[old])

    def _reserve(self, path: Path, nbytes: int) -> bool:
        """Room on disk for a pack about to be written, made before it is written: the packs it
        pushes out have their deletions queued ahead of the write, and the reservation counts
        until the pack joins the index, so the directory (temporary files included) stays
        within its budget while writes are in flight. False: it does not fit, not written."""
        slot = ("writing", str(path))
        evicted = self.index.disk.add(slot, nbytes, self._writing)
        if slot in evicted:
            evicted.remove(slot)
            self._evicted(evicted)
            return False
        self._writing.add(slot)
        self._evicted(evicted)
        return True

    def _written(self, path: Path) -> None:
        """A pack's write ended (done or failed): its reservation gives way to what it holds."""
        slot = ("writing", str(path))
        if slot in self._writing:
            self._writing.discard(slot)
            self.index.disk.remove(slot)

    def _drop_pack(self, path: Path, delete: bool = True) -> None:
        for key in self.packs.pop(path, []):
            if self.file_of.get(key) == path:
                del self.file_of[key]
                self.index.disk.remove(key)
        if delete:
            self._deleting.add(path)  # not rediscovered while its deletion waits in the queue
            self._writes.put(("delete", path, None))

    def _read(self, path: Path, kind: str, keys: list[Key]) -> None:
        t0 = time.perf_counter()
        try:
            entries = read_pack(path, self.fingerprint, kind, [k[1].hex() for k in keys], self.expect[kind])
            if self.pin:
                entries = {h: {n: t.pin_memory() for n, t in e.items()} for h, e in entries.items()}
            self._done.put(("read", path, (entries, time.perf_counter() - t0)))
        except EntryError as e:
            self._done.put(("reject", path, str(e)))
        self._arrived.set()

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                self._writes.task_done()
                return
            op, path, payload = job
            try:
                if op == "delete":
                    path.unlink(missing_ok=True)
                    self._deleting.discard(path)
                else:
                    kind, entries, ready = payload
                    if ready is not None:
                        ready.synchronize()  # the device-to-host copies of this pack are done
                    n = write_pack(path, kind, {k[1].hex(): t for k, t in entries}, self.fingerprint)
                    self._done.put(("written", path, ([k for k, _ in entries], n)))
            except OSError as e:
                log.warning("prefix cache: could not write %s: %s", path, e)
                if op == "write":
                    self._done.put(("unwritten", path, None))
            finally:
                self._writes.task_done()

    # ---- the engine thread ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Disk entries are being read for a waiting request."""
        return bool(self.index.prefetching)

    def flush(self) -> None:
        """Block until every queued write has reached the directory."""
        self._writes.join()

    def wait(self, timeout: float) -> None:
        self._arrived.wait(timeout)
        self._arrived.clear()

    def prefetch(self, keys: list[Key]) -> None:
        """Read the packs holding these disk entries (each pack once, all its entries)."""
        for key in keys:
            if self.index.where(key) != "disk":
                continue
            path = self.file_of.get(key)
            if path is None:  # never expected: an index entry without its pack would wait forever
                self.index.disk.remove(key)
                continue
            if path in self._reading:
                continue
            mine = {k for k in self.packs[path] if self.file_of.get(k) == path}
            self._reading[path] = mine
            self.index.prefetching.update(mine)
            self._readers.submit(self._read, path, key[0], list(self.packs[path]))

    def poll(self) -> None:
        """Take the threads' results: written packs join the disk index, read ones host memory,
        rejected ones are deleted (their prefixes are recomputed)."""
        stats = self.index.stats["disk"]
        while True:
            try:
                op, path, payload = self._done.get_nowait()
            except queue.Empty:
                return
            if op in ("written", "unwritten"):
                self._written(path)
                if op == "written":
                    keys, n = payload
                    stats.bytes_written += n
                    self._index_pack(path, keys, n)
                continue
            self.index.prefetching.difference_update(self._reading.pop(path, set()))
            keys = [k for k in self.packs.get(path, []) if self.file_of.get(k) == path]
            if op == "read":
                entries, seconds = payload
                stats.hits += len(keys)
                stats.bytes_read += sum(self.entry_bytes[k[0]] for k in keys)
                stats.load_seconds += seconds
                for key in keys:
                    self.index.disk.touch(key)
                    if self.index.where(key) == "disk":
                        self._put_host(key, entries[key[1].hex()])
            else:  # reject
                stats.rejected += 1
                log.warning("prefix cache: dropped a bad entry, recomputing instead: %s", payload)
                self._drop_pack(path)

    def _put_host(self, key: Key, tensors: dict[str, torch.Tensor]) -> None:
        self.host[key] = tensors
        for old in self.index.cpu.add(key, self.entry_bytes[key[0]], self._held):
            self.host.pop(old, None)
            self.index.stats["cpu"].evictions += 1

    def clear_host(self) -> None:
        """Empty host memory (POST /reset_prefix_cache); disk reads in flight land afterwards."""
        for key in self.index.cpu.keys():
            self.index.cpu.remove(key)
        self.host.clear()

    def store(self, cache, blocks: list[tuple[bytes, int]], states: list[tuple[bytes, int]]) -> None:
        """Copy what the pools published (or, writing back, evicted) into host memory, and queue
        it for the disk: each entry once, and only one no tier holds yet."""
        held = set()

        def fresh(key: Key) -> bool:
            if key in held or self.index.where(key) is not None:
                return False
            held.add(key)
            return True

        blocks = [(h, b) for h, b in blocks if fresh(("block", h))]
        new = [(("block", h), e) for (h, _), e in zip(blocks, self.port.read_blocks([b for _, b in blocks]))]
        new += [(("state", h), self.port.read_state(slot)) for h, slot in states if fresh(("state", h))]
        packs: dict = {}  # this call's blocks in one pack, each state in its own
        for key, views in new:
            if self.pin:
                host = {
                    n: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                    for n, v in views.items()
                }
            else:
                host = {n: v.clone() for n, v in views.items()}
            self.index.stats["cpu"].bytes_written += self.entry_bytes[key[0]]
            self._put_host(key, host)
            packs.setdefault(key if key[0] == "state" else "blocks", []).append((key, host))
        if self._calibrated and self.dir is None and self.root is not None and not cache.calibrating:
            self._open_scales(cache)  # before the first entry written under them
        if self.dir is not None and packs:
            ready = None
            if self.pin:
                ready = torch.cuda.Event()
                ready.record()
            for entries in packs.values():
                key, path = entries[0][0], self.pack_path(entries[0][0])
                if self._reserve(path, pack_bytes([t for _, e in entries for t in e.values()])):
                    self._writes.put(("write", path, (key[0], entries, ready)))

    def hold(self, blocks: list[tuple[bytes, int]], states: list[tuple[bytes, int]]) -> None:
        """The host entries a scheduled step loads stay until `load` has copied them: under
        write_back what scheduling evicted is stored in between, and a host tier that evicts
        dropped them (the step then failed on the missing entry, 81 of 2,000 requests)."""
        self._held = {("block", h) for h, _ in blocks} | {("state", h) for h, _ in states}
        for key in self._held:
            self.index.cpu.touch(key)

    def load(self, cache, blocks: list[tuple[bytes, int]], states: list[tuple[bytes, int]]) -> None:
        """Fill fresh blocks and live slots from host memory, at the start of the step that reads them."""
        t0 = time.perf_counter()
        st = self.index.stats["cpu"]
        try:
            self.port.write_blocks([b for _, b in blocks], [self.host[("block", h)] for h, _ in blocks], self.pin)
            for h, slot in states:
                self.port.write_state(slot, self.host[("state", h)], self.pin)
        finally:
            self._held = set()
        for key in [("block", h) for h, _ in blocks] + [("state", h) for h, _ in states]:
            self.index.cpu.touch(key)
        n = len(blocks) + len(states)
        if n:
            st.hits += n
            st.bytes_read += len(blocks) * self.entry_bytes["block"] + len(states) * self.entry_bytes["state"]
            st.load_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Finish queued writes (a restart then finds them) and stop the threads."""
        self._finalizer()


def _stop(readers: ThreadPoolExecutor | None, writes: queue.Queue, threads: list, timeout: float = 30.0) -> None:
    if readers is not None:
        readers.shutdown(wait=True)
    if threads:
        writes.put(None)
        for t in threads:
            t.join(timeout)
        threads.clear()


def cache_device(cache) -> torch.device:
    t = next(t for t in cache.latent + cache.recurrent if t is not None)
    return t.device
