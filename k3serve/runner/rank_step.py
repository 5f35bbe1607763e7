"""One rank's half of a step: StepInputs (the prepared batch, plain data) -> forward -> logits.

The driver builds `StepInputs` once per step from the ScheduledBatch; under tensor parallelism
it is broadcast to every worker (distributed/executor.py), and every rank runs the same
`RankRunner.forward`, so their collectives line up: state restores, the model (all-reduces
inside), checkpoint saves, then the logits of the sampling rows and of the prompt-logprob rows
(vocab-parallel all-gathers). Only the driver samples; verify rollbacks come back as a second,
small command. Reference: vLLM v1 `worker/worker_base.py` (execute_model on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3serve.cache.sizing import CachePlan
from k3serve.models.kimi import KimiForCausalLM
from k3serve.parallel.dcp import layout_of, shard_of
from k3serve.forward import RECORDS_IN_FLIGHT, CacheTensors, ForwardBatch
from k3serve.spec_decode.rollback import rollback_states


@dataclass
class StepInputs:
    input_ids: list[int]  # [N] the step's tokens, sequences concatenated
    seq_lens: list[int]
    context_lens: list[int]
    state_slots: list[int]
    block_tables: list[list[int]]
    block_size: int
    verify: list[int]  # batch indices of sequences verifying drafts
    restore: list[tuple[int, int]]  # (checkpoint slot, live slot) copied before the forward
    save: list[tuple[int, int]]  # (live slot, checkpoint slot) copied after it
    logit_rows: list[int]  # flat rows whose logits are sampled
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # (first row, count) per prompt-logprob span
    media_rows: torch.Tensor | None = None  # [M] rows taking vision-tower embeddings
    media_embeds: torch.Tensor | None = None  # [M, d]
    # a pure decode sampled on the device (graph backend): each row's sampling/device.py values
    sampling: list[dict] | None = None
    # a verify step's slot rows (cache/draft_slots.py), one per sequence, when the cache has them
    draft_rows: list[list[int]] | None = None
    # with `sampling`: the rows' grammar bitmask (xgrammar's int32 [n, ceil(V / 32)]), when any is constrained
    token_mask: torch.Tensor | None = None
    # with `sampling`: each row's (prompt, output) token ids when any row uses penalties
    histories: list[tuple[list[int], list[int]]] | None = None


@dataclass
class StepResult:
    logits: torch.Tensor | None  # [len(logit_rows), V] fp32 on the CPU
    prompt_logits: list[torch.Tensor]  # one fp32 [count, V] per prompt_rows span
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, d], the taps asked for
    sampled: list[int] | None = None  # the ids the step sampled on the device (then logits is None)
    faulty: list[bool] | None = None  # ... and the rows whose logits were the model's fault
    # a static verify step: each position's state went to its slot row, nothing to roll back
    rows_written: bool = False
    static: bool = False  # the step ran as the graph backend's static step (runner/graph_step.py)


def _static_result(out, inp: StepInputs) -> StepResult:
    """A static step's GraphOut (runner/graph_step.py) as the StepResult the driver finishes."""
    return StepResult(out.logits, [], out.taps, out.ids, out.faults, bool(inp.verify), static=True)


class RankRunner:
    """The model and this rank's cache tensors (KDA state of this rank's heads, the whole latent)."""

    @classmethod
    def allocate(cls, model: KimiForCausalLM, alloc, device: torch.device) -> "RankRunner":
        """This rank's cache and static steps for an executor's Allocation (executor/base.py):
        the same on every rank, in the driver's process or a worker's."""
        graph = alloc.graph
        k = graph.num_speculative_tokens if graph is not None else 0
        cache = allocate_cache(
            model, alloc.plan, getattr(torch, alloc.kv_dtype), device, graph is not None, alloc.calculate_kv_scales, k
        )
        graphs = None
        if graph is not None:
            from k3serve.runner.graph_step import GraphSteps

            graphs = GraphSteps(
                model, cache, device, graph.config, graph.max_num_seqs, graph.eager, alloc.masked_ids, k
            )
        balancer = None
        if alloc.eplb is not None:
            from k3serve.runner.eplb import ExpertBalancer

            balancer = ExpertBalancer(model, alloc.eplb, alloc.nodes)
        return cls(model, cache, device, graphs, balancer)

    def __init__(self, model: KimiForCausalLM, cache: CacheTensors, device: torch.device, graphs=None, balancer=None):
        """`graphs`: runner/graph_step.py GraphSteps, which run pure decode steps (graph backend);
        `balancer`: runner/eplb.py ExpertBalancer (--enable-eplb), stepped before each forward."""
        self.model, self.cache, self.device, self.graphs = model, cache, device, graphs
        self.balancer = balancer
        # verify passes' per-position KDA states until their rollback command (which arrives after
        # the driver sampled: a second, small command under tensor parallelism), keyed by the
        # pass's verifying slots: with pipeline stages two steps are in flight, and a rollback
        # may follow the next step's forward (at most RECORDS_IN_FLIGHT passes are kept)
        self.records: dict[tuple[int, ...], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    @torch.inference_mode()
    def forward(self, inp: StepInputs, taps: tuple[int, ...] = (), defer: bool = False):
        """This rank's part of the step; rank 0's StepResult. `defer` (the driver under pipeline
        stages): return once this stage has sent its rows on, with a callable that receives
        the later stages' answers (executor launch / collect)."""
        if self.balancer is not None:  # every rank, every step: a due rebalance runs between steps
            self.balancer.step()
        ep_rows = self.graphs.decide(inp, taps) if self.graphs is not None else None
        if ep_rows is not None:
            self.copy_states(inp.restore)
            out = self.graphs.run(inp, taps, ep_rows, defer)
            self.copy_states(inp.save)
            if callable(out):  # the driver's stage has sent its rows on: the rest comes later
                return lambda: _static_result(out(), inp)
            return _static_result(out, inp)
        fb = ForwardBatch(
            input_ids=torch.tensor(inp.input_ids, dtype=torch.long, device=self.device),
            seq_lens=inp.seq_lens,
            context_lens=inp.context_lens,
            state_slots=inp.state_slots,
            block_tables=inp.block_tables,
            block_size=inp.block_size,
            verify=inp.verify,
        )
        if inp.media_rows is not None:
            fb.media_rows, fb.media_embeds = inp.media_rows.to(self.device), inp.media_embeds.to(self.device)
        self.copy_states(inp.restore)  # a prefix hit resumes from its checkpoint
        out = self.model(fb, self.cache, taps)
        hidden = out.hidden  # [N, d]; None on a stage before the last
        if out.kda_records:
            self.records[tuple(inp.state_slots[i] for i in inp.verify)] = out.kda_records
            while len(self.records) > RECORDS_IN_FLIGHT:  # a pass whose requests all kept their last state
                del self.records[next(iter(self.records))]
        self.copy_states(inp.save)  # states exactly at chunk ends become checkpoints
        prompt, logits = [], None
        if hidden is not None:
            prompt = [self.model.compute_logits(hidden[b : b + n]).float().cpu() for b, n in inp.prompt_rows]
            if inp.logit_rows:  # a pure decode step asks every row in order: no gather
                every = inp.logit_rows == list(range(hidden.shape[0]))
                rows = hidden if every else hidden[torch.tensor(inp.logit_rows, device=self.device)]
                logits = self.model.compute_logits(rows).float().cpu()
        if self.model.pipe is not None:
            args = (inp, self.model.pipe, logits, prompt, out.taps, taps)
            if defer and self.model.pipe.rank == 0:
                return lambda: self._receive_result(*args)
            return self._pipeline_result(*args)
        return StepResult(logits, prompt, out.taps)

    @torch.inference_mode()
    def _receive_result(self, *args) -> StepResult:
        return self._pipeline_result(*args)

    def _pipeline_result(self, inp: StepInputs, pipe, logits, prompt, captured: dict, taps) -> StepResult:
        """Pipeline stages: each later stage's TP rank 0 sends the driver (rank 0) the tap layers'
        states it captured, the last one also the logits; the driver returns all of it."""
        n, d, vocab = len(inp.input_ids), self.model.cfg.hidden_size, self.model.cfg.vocab_size
        captured = {i: t for i, t in captured.items() if pipe.stage.holds(i)}  # the taps of this stage
        if pipe.reports:
            out = [captured[i] for i in sorted(captured)]
            if pipe.stage.last:
                out += ([logits] if logits is not None else []) + prompt
            pipe.to_driver(out)
        if pipe.rank != 0:
            return StepResult(None, [])
        got = dict(captured)
        for s in range(1, pipe.stage.count):
            here = sorted(i for i in taps if i in pipe.stages[s])
            specs = [((n, d), self.model.dtype)] * len(here)
            last = s == pipe.stage.count - 1
            if last:
                specs += [((len(inp.logit_rows), vocab), torch.float32)] if inp.logit_rows else []
                specs += [((c, vocab), torch.float32) for _, c in inp.prompt_rows]
            received = pipe.from_rank(s * pipe.tp_size, specs)
            got.update(zip(here, received))
            if last:
                rest = received[len(here) :]
                logits = rest.pop(0).cpu() if inp.logit_rows else None
                prompt = [t.cpu() for t in rest]
        return StepResult(logits, prompt, got)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        if len(pairs) == 1:  # a prefill's checkpoint: a view and a copy per tensor (~2 vs ~10 us for index ops)
            ((s, d),) = pairs
            for t in self.cache.recurrent + self.cache.conv:
                if t is not None:
                    t[d].copy_(t[s])
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for t in self.cache.recurrent + self.cache.conv:
            if t is not None:
                t[dst] = t[src]

    @torch.inference_mode()
    def idle(self) -> None:
        """DP-attention + EP with nothing scheduled: no tokens, but every MoE layer's collectives
        (a padding static step when the other ranks run static, runner/graph_step.py)."""
        if self.balancer is not None:
            self.balancer.step()
        ep_rows = self.graphs.decide(None) if self.graphs is not None else None
        if ep_rows is not None:
            self.graphs.run_padding(ep_rows)
            return
        self.model.idle_moe()

    def dp_forward(
        self, inp: StepInputs, taps: tuple[int, ...] = (), leader: bool = True
    ) -> tuple[StepResult | None, dict, dict]:
        """A DP-attention worker's forward: the result (with the hidden states [N, d] of the
        `taps` layers a DSpark drafter in the driver reads) and, riding along, its parallel_stats
        (the driver's stats snapshot after every step must not cost a second round trip).
        With TP inside the DP rank, its other TP ranks (not `leader`) send back their stats alone:
        each routed its own share of the rows, so the expert load is theirs summed."""
        result = self.forward(inp, taps)
        return (result, self.parallel_stats()) if leader else (None, self.parallel_stats())

    def graph_steps(self) -> tuple[int, int] | None:
        """(static steps run, buckets built) on this rank (graph backend), else None."""
        return (self.graphs.steps, self.graphs.compiles) if self.graphs is not None else None

    def pipe_stats(self) -> tuple[int, float]:
        """(this rank's pipeline stage, seconds it has waited for another stage)."""
        pipe = self.model.pipe
        return (pipe.stage.index, pipe.waited_s) if pipe is not None else (0, 0.0)

    def parallel_stats(self) -> dict:
        """This rank's collective totals and the expert load it counted, for /metrics (engine/stats.py)."""
        group = self.model.ep or self.model.tp
        if group.size == 1:
            return {}
        c = group.stats
        out = {"tp_collectives": tuple((k, c.calls[k], c.bytes[k], c.seconds[k]) for k in sorted(c.calls))}
        loads = [m.expert_load for m in self.model.moe_layers() if m.expert_load is not None]
        if loads:
            total = sum(loads)  # [E] over the MoE layers
            out["expert_tokens_per_rank"] = tuple(total.view(group.size, -1).sum(1).tolist())
        if self.balancer is not None:
            out.update(self.balancer.stats())
        return out

    def rollback(self, slots: list[int], accepted: list[int]) -> None:
        """After a verify pass: each live slot takes its recorded state at the accepted position."""
        records = self.records.pop(tuple(slots), {})  # {}: this rank holds no KDA layer
        rollback_states(
            self.cache,
            records,
            slots,
            accepted,
            getattr(getattr(getattr(self.model, "model", None), "backend", None), "kernels", None),
        )

    def read_state(self, slot: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """This rank's KDA state of one slot (its heads): recurrent [h, D, D], conv [K-1, 3hD] per layer."""
        return (
            {i: t[slot].clone() for i, t in enumerate(self.cache.recurrent) if t is not None},
            {i: t[slot].clone() for i, t in enumerate(self.cache.conv) if t is not None},
        )

    def read_rows(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """`latent_rows` on the CPU (what travels back to the driver)."""
        return {i: t.cpu() for i, t in self.latent_rows(rows).items()}

    def latent_rows(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """This rank's latent rows [R, c + r] per MLA layer (whole on every rank) of the global
        rows `rows`; under decode context parallelism the [R'] of them it holds, in the order of
        `rows` (the executor interleaves the ranks' parts: parallel/dcp.py)."""
        rows = rows.to(self.cache.device)
        layout = layout_of(self.model.tp, self.cache.block_size)
        if layout is not None:
            rows = layout.split(rows, shard_of(self.model.tp.rank, layout.size))[1]
        return {i: t[rows] for i, t in enumerate(self.cache.latent) if t is not None}

    def write_state(
        self,
        slot: int,
        recurrent: dict,
        conv: dict,
        rows: torch.Tensor | None = None,
        latent: dict | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Install state on this rank: its heads' state of `slot`, and latent rows in the cache's
        encoding (whole on every rank). `non_blocking`: host tensors in pinned memory copy in
        stream order (the prefix tiers' loads)."""
        for i, t in recurrent.items():
            if self.cache.recurrent[i] is None:  # another pipeline stage's layer
                continue
            self.cache.recurrent[i][slot].copy_(t, non_blocking=non_blocking)
            self.cache.conv[i][slot].copy_(conv[i], non_blocking=non_blocking)
        if latent:  # rows and their values may arrive on the CPU (pickled)
            rows = rows.to(self.cache.device)
            layout = layout_of(self.model.tp, self.cache.block_size)
            if layout is not None:  # whole blocks' rows: this rank writes the ones it holds
                mine, rows = layout.split(rows, shard_of(self.model.tp.rank, layout.size))
                latent = {i: t[mine.to(t.device)] for i, t in latent.items()}
        for i, t in (latent or {}).items():
            dst = self.cache.latent[i]
            if dst is not None:
                dst[rows] = t.to(dst.device, dst.dtype, non_blocking=non_blocking)


def allocate_cache(
    model: KimiForCausalLM,
    plan: CachePlan,
    kv_dtype: torch.dtype,
    device: torch.device,
    scratch: bool = False,
    calculate_kv_scales: bool = False,
    draft_positions: int = 0,
) -> CacheTensors:
    """This rank's cache for `plan`: checkpoint slots (prefix caching) follow the live slots in
    the same state tensors; under tensor parallelism KDA state holds this rank's heads.
    `scratch`: a slot and a block for the graph backend's padding rows; `draft_positions` k: the
    spare slots of slot-per-draft rows after them (cache/draft_slots.py). An fp8 latent cache
    takes the checkpoint's per-layer scales, or calibrates them (`calculate_kv_scales`)."""
    cache = CacheTensors.allocate(
        model.cfg,
        plan.num_slots + plan.num_checkpoints,
        plan.num_blocks,
        plan.block_size,
        kv_dtype=kv_dtype,
        device=device,
        tp_size=model.tp.size,
        scratch=scratch,
        state_dtype=getattr(torch, plan.state_dtype),
        spare=plan.num_slots * draft_positions if scratch else 0,
        layers=model.model.stage.layers,
        latent_shards=model.tp.dcp,
    )
    scales = getattr(model, "kv_scales", {})
    if kv_dtype == torch.float8_e4m3fn and (scales or calculate_kv_scales):
        cache.use_scales(scales, calculate_kv_scales)
    return cache


def weight_bytes(model: KimiForCausalLM) -> int:
    """Bytes of every parameter and buffer (routed experts are buffers, MXFP4 counted packed)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
