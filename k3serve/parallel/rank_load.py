"""This rank's share of a checkpoint, read straight from the files' mmap, one tensor at a time.

For each weight the rank keeps it reads only the rows, columns or experts it keeps
(safetensors' `get_slice`: the bytes of other ranks' slices are never copied), puts them in
the canonical form (weights/loader.py `canonicalize`) on `device`, and hands them over before
the next one is read: no rank holds the whole checkpoint, nor its whole shard on the host.
Experts of other ranks are skipped unread. The rules are parallel/shard.py's, applied to what
is read instead of to a loaded tensor; `shard_weights(load_weights(...))` is the reference
(tests/distributed/test_rank_load.py). K3's padded A_log, and a dimension the rank count does
not divide (whose error shard_weights names), are read whole and cut by the reference rule.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from k3serve.config.model_config import ModelConfig
from k3serve.parallel.eplb_policy import expert_slots, initial_slot
from k3serve.parallel.group import TPGroup, vocab_shard
from k3serve.config.stages import Stage, on_stage
from k3serve.parallel.shard import _COLUMNS, _ROWS, _VOCAB, Weight, check_expert_split, shard_weights
from k3serve.weights.checkpoint import CheckpointIndex
from k3serve.weights.loader import canonicalize, check_finite, validate_checkpoint

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts\.)(\d+)(\.w[123]\.weight)$")
_PARTS = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")  # one module's


@dataclass
class ReadStats:
    """Bytes this rank copied out of the checkpoint files (the mmap's pages it touched)."""

    bytes_read: int = 0


def rank_weights(
    path: str | Path,
    cfg: ModelConfig,
    tp: TPGroup,
    ep: TPGroup | None,
    device,
    stats: ReadStats | None = None,
    progress: bool = False,
    stage: Stage | None = None,
) -> Iterator[tuple[str, Weight]]:
    """(canonical name on this rank, weight on `device`) for every text-model weight it keeps
    (`stage`: of its pipeline stage's layers only)."""
    index = CheckpointIndex.open(path)
    specs = [s for s in validate_checkpoint(index, cfg) if not s.vision]
    prefix = cfg.tensor_prefix
    groups: dict[str, list[str]] = {}  # canonical weight -> its stored tensors
    for s in specs:
        key = s.name[len(prefix) :] if prefix and s.name.startswith(prefix) else s.name
        base = next((key[: -len(p)] for p in _PARTS if key.endswith(p)), None)
        groups.setdefault(base + ".weight" if base is not None else key, []).append(s.name)
    order = sorted(groups, key=lambda c: min((index.tensors[n].file, index.tensors[n].offset) for n in groups[c]))
    handles: dict[Path, object] = {}
    stats = stats if stats is not None else ReadStats()
    for canon in tqdm(order, desc="loading weights", unit="tensor", disable=not progress):
        keep = _plan(canon, cfg, tp, ep) if on_stage(canon, cfg, stage) else None
        if keep is None:
            continue  # another rank's expert: not read
        raw, whole = {}, False
        for name in groups[canon]:
            info = index.tensors[name]
            fh = handles.get(info.file) or handles.setdefault(info.file, safe_open(str(info.file), "pt"))
            t, sliced = _read(fh, name, info.shape, keep, cfg, tp)
            whole |= keep.dim is not None and not sliced
            check_finite(t, name, info.file)
            stats.bytes_read += t.numel() * t.element_size()
            raw[name] = t
        ((key, w),) = canonicalize(raw, cfg).items()
        if keep.reference or (keep.split and whole):  # K3's A_log, or a split shard_weights refuses by name
            ((name, w),) = shard_weights({key: w}, cfg, tp, ep).items()
        else:
            name = keep.name
            if keep.vocab and w.shape[0] < keep.length:  # the last shard: zero rows up to the common width
                w = torch.cat((w, w.new_zeros(keep.length - w.shape[0], *w.shape[1:])))
        yield name, _contiguous(w).to(device)


@dataclass(frozen=True)
class _Keep:
    name: str  # the weight's name on this rank (experts renumbered under expert parallelism)
    dim: int | None = None  # the logical dim read in part (0 rows, 1 columns); None: whole
    start: int = 0
    length: int = 0
    split: bool = False  # an even split of the stored dim over the TP ranks (start, length from its size)
    vocab: bool = False  # vocabulary rows, the last shard padded with zero rows
    reference: bool = False  # read whole, cut by shard_weights itself


def _plan(canon: str, cfg: ModelConfig, tp: TPGroup, ep: TPGroup | None) -> _Keep | None:
    """What this rank keeps of a canonical weight (parallel/shard.py's rules), or None."""
    m = _EXPERT.match(canon)
    if m:
        group = ep if ep is not None else tp
        if group.size == 1:
            return _Keep(canon)
        e, which = int(m[2]), m[3]
        if group.expert_parallel:  # whole experts, into the slot the (initial EPLB) placement gives
            E = cfg.moe.num_experts
            j = initial_slot(e, group.rank, expert_slots(E, group), E)
            return None if j is None else _Keep(f"{m[1]}{j}{which}")
        n = group.split(cfg.moe.expert_intermediate_size, "moe_intermediate_size")
        dim = 1 if which == ".w2.weight" else 0  # w2 [L, I] splits its input channels
        if dim == 1:
            check_expert_split(cfg, group)
        return _Keep(canon, dim, group.rank * n, n)
    if tp.size == 1:
        return _Keep(canon)
    if canon.endswith(_VOCAB):
        start, rows = vocab_shard(cfg.vocab_size, tp)
        return _Keep(canon, 0, start, rows, vocab=True)
    if canon.endswith("A_log"):
        return _Keep(canon, reference=True)
    if canon.endswith(_ROWS):
        return _Keep(canon, 0, split=True)
    if canon.endswith(_COLUMNS):
        return _Keep(canon, 1, split=True)
    return _Keep(canon)


def _read(fh, name: str, shape: tuple[int, ...], keep: _Keep, cfg: ModelConfig, tp: TPGroup):
    """(the stored tensor or the part of it `keep` names, whether it was cut): packed halves and
    scale groups of an MXFP4 / NVFP4 matrix in their own units, a global scale whole."""
    if keep.dim is None or name.endswith(".weight_global_scale"):
        return fh.get_tensor(name), keep.dim is None
    start, length = keep.start, keep.length
    if keep.split:
        if shape[keep.dim] % tp.size:
            return fh.get_tensor(name), False
        length = shape[keep.dim] // tp.size
        start = tp.rank * length
    elif keep.dim == 1 and name.endswith(".weight_packed"):
        start, length = start // 2, length // 2
    elif keep.dim == 1 and name.endswith(".weight_scale"):
        g = cfg.quant.group_size
        start, length = start // g, length // g
    if keep.vocab:
        length = max(0, min(length, shape[0] - start))
    index = (slice(None),) * keep.dim + (slice(start, start + length),)
    return fh.get_slice(name)[index], True


def _contiguous(w: Weight) -> Weight:
    """A column slice can come back strided; the kernels' packing and the parameters want rows."""
    if isinstance(w, torch.Tensor):
        return w.contiguous()
    parts = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}  # PackedMXFP4 / PackedNVFP4
    return dataclasses.replace(w, **{k: t.contiguous() for k, t in parts.items() if isinstance(t, torch.Tensor)})
