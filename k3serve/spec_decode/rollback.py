"""KDA state rollback after verification: per-position state buffers (serving-notes.md §3.1,
design 1 as in vLLM's native GDN path and SGLang's intermediate caches). The eager paths' form;
the graph backend's static verify step writes each position's state to a slot of its own
instead, and rolls back by choosing a slot (cache/draft_slots.py, no copy).

During a verify pass each KDA layer runs the 1 + k positions of a speculating request as
consecutive recurrent steps and records the recurrent state [H, D, D] and conv window
[K-1, 3P] after every position; the forward returns them in `ForwardOut.kda_records[layer] =
(rec [S, T, ...], conv [S, T, ...])`, S = speculating sequences in batch order. After acceptance of tau drafts
the request's live slot takes the entry at position tau (the last committed input: the token
fed at position 0 plus tau accepted drafts). MLA needs nothing: rows past the committed length
are rewritten before they are ever read. The buffers live for one step only.
"""

from __future__ import annotations

import torch

from k3serve.forward import CacheTensors

FEW = 2  # rolled-back sequences copied one by one (a single user's step: ~30 vs ~60 us on 4 KDA layers)


def rollback_states(
    cache: CacheTensors,
    records: dict[int, tuple[torch.Tensor, torch.Tensor]],
    slots: list[int],
    accepted: list[int],
    kernels=None,
) -> None:
    """For the j-th speculating sequence: live slot slots[j] <- recorded state at accepted[j];
    accepted[j] = -1 leaves the slot as the pass left it (every draft accepted: its live state is
    the last position's already). With the compiled kernels and CPU
    states, every layer's copies in one call (kernels/cpu/ops/kda_decode.cpp kda_rollback: ~3 vs
    ~25 us for a single user's 4 KDA layers); the torch copies below are its reference."""
    keep = [j for j, a in enumerate(accepted) if a >= 0]
    layers = list(records)
    if keep and kernels is not None and all(cache.recurrent[i].device.type == "cpu" for i in layers):
        kernels.kda_rollback(
            [cache.recurrent[i] for i in layers],
            [cache.conv[i] for i in layers],
            [records[i][0] for i in layers],
            [records[i][1] for i in layers],
            slots,
            accepted,
        )
    elif len(keep) <= FEW:  # plain views and copies: half the cost of index_put at these counts
        for layer, (rec_buf, conv_buf) in records.items():
            for j in keep:
                cache.recurrent[layer][slots[j]].copy_(rec_buf[j, accepted[j]])
                cache.conv[layer][slots[j]].copy_(conv_buf[j, accepted[j]])
    else:
        device = cache.device  # index tensors beside the states they index (a GPU's, where the cache is)
        dst = torch.tensor([slots[j] for j in keep], device=device)
        pos = torch.tensor([accepted[j] for j in keep], device=device)
        rows = torch.tensor(keep, device=device)
        for layer, (rec_buf, conv_buf) in records.items():
            cache.recurrent[layer][dst] = rec_buf[rows, pos].to(cache.recurrent[layer].dtype)
            cache.conv[layer][dst] = conv_buf[rows, pos]
