"""The graph backend under pipeline stages (parallel/pipe.py): each rank runs its stage's layers
as a compiled static step per bucket (runner/graph_step.py GraphSteps), and the hand-offs happen
between the compiled calls: the previous stage's [bank + 1, N, d] is received into the step's
input buffer (StaticStep.incoming) before the call, the stage's own is sent on after it. Then
the later stages' TP rank 0 report to the driver, in the eager path's order
(RankRunner._pipeline_result): each its tap layers, the last stage also its sampled ids and
model-fault flags [2, n], or its logits [rows, V]."""

from __future__ import annotations

import torch


def static_stage(model, step, cache, taps):
    """A stage before the last: its layers on the static step. Returns its output [bank + 1, N, d]
    in static row order (the next stage's static rows: both run the same bucket) and its tap
    layers' hidden states in the flat batch's row order."""
    step = step.expand()
    out = model(step, cache, taps)
    if step.T == 1:
        return out.hidden, out.taps
    return out.hidden, {i: t[step.gather] for i, t in out.taps.items()}


def report(pipe, inp, out) -> None:
    """A stage after the first (its TP rank 0): `out`, its compiled call's outputs (their last
    item the taps), to the driver."""
    if not pipe.reports:
        return
    m = len(inp.seq_lens) if inp.sampling is not None else sum(inp.seq_lens)
    captured = out[-1]
    sent = [captured[i][:m] for i in sorted(captured)]
    if pipe.stage.last:
        if inp.sampling is not None:
            sent.append(torch.stack((out[0], out[1].long()))[:, :m])
        else:
            sent.append(out[0][:m].float())
    pipe.to_driver(sent)


def received(pipe, model, inp, out, taps: tuple[int, ...]) -> tuple:
    """The driver (stage 0, TP rank 0): (logits, ids, faults, taps) of the step from its own
    call's outputs `out` and what each later stage reported."""
    n, rows = len(inp.seq_lens), sum(inp.seq_lens)
    m = n if inp.sampling is not None else rows
    d, vocab = model.cfg.hidden_size, model.cfg.vocab_size
    got = {i: t[:m] for i, t in out[-1].items()}
    result = None
    for s in range(1, pipe.stage.count):
        here = sorted(i for i in taps if i in pipe.stages[s])
        specs = [((m, d), model.dtype)] * len(here)
        last = s == pipe.stage.count - 1
        if last:
            specs.append(((2, n), torch.long) if inp.sampling is not None else ((rows, vocab), torch.float32))
        got_here = pipe.from_rank(s * pipe.tp_size, specs)
        got.update(zip(here, got_here))
        if last:
            result = got_here[-1]
    if inp.sampling is not None:
        ids, faults = result.tolist()
        return None, ids, [bool(f) for f in faults], got
    return result.cpu(), None, None, got
