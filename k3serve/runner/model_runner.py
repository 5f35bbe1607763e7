"""ModelRunner: the driver's half of a step, around the executor's forward.

`prepare`: ScheduledBatch -> StepInputs (the plain data every rank runs, runner/rank_step.py) and
which logits rows belong to which sequence; `finish`: the executor's StepResult -> sampled
tokens, verified drafts and the rollback the executor owes an eager verify pass -> StepOutput.
It holds what sampling needs across steps: one torch.Generator per request, grammar states,
prompt media; the model and its cache live behind the executor (executor/base.py).
References: nano-vllm `engine/model_runner.py`, vLLM v1 `worker/gpu_model_runner.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from k3serve.sampling.seeds import request_seed
from k3serve.cache.sizing import CachePlan
from k3serve.runner.rank_step import StepInputs, StepResult
from k3serve.sampling.device import DeviceSamplingParams, device_samplable, model_faults, row_values, sample
from k3serve.sampling.sampler import MODEL_FAULT, Sampler, SampleResult, model_fault_rows, sampled_token
from k3serve.multimodal.prompt_media import PromptMedia
from k3serve.sampling.grammar import Constraint, refuse
from k3serve.sampling_params import ParamError
from k3serve.sampling.logits_process import apply_bias_and_penalties, suppressed_ends
from k3serve.sampling.grammar import ConstraintStats
from k3serve.scheduler.batch import ScheduledBatch
from k3serve.outputs import PromptLogprob, SampledToken, StepOutput
from k3serve.scheduler.request import Request

log = logging.getLogger("k3serve.engine")


@dataclass
class PreparedStep:
    """One step's plan, built once: what every rank runs and how its logits map back."""

    batch: ScheduledBatch
    inputs: StepInputs
    bounds: list[tuple[int, int]]  # each sequence's flat rows [begin, end)
    spans: list[tuple[int, int]]  # (sequence index, first logits row) of the sampling sequences
    asks: list[tuple[int, int, int, int]]  # prompt-logprob spans (_prompt_logprob_spans)
    # the layers whose hidden states the step returns for the drafter: none while the draft-length
    # policy rests the drafter through the next step (capturing and keeping them cost a DSpark
    # engine ~5% of a 16-stream step it did not draft in)
    taps: tuple[int, ...] = ()


class ModelRunner:
    def __init__(
        self,
        vocab_size: int,
        plan: CachePlan,
        seed: int = 0,
        device: str | torch.device = "cpu",
        spec=None,
        masked_ids: list[int] = (),
        device_sampling: bool = False,
    ):
        """`device`: where the model runs (prompt media rows go there). `device_sampling`: the
        graph backend without speculation samples on the device (sampling/device.py): fused
        into the static step when every row can, else the same counter-based draws on the host
        logits; speculation keeps the host sampler (its verification draws from the requests'
        generators)."""
        self.vocab_size, self.plan, self.seed, self.device = vocab_size, plan, seed, torch.device(device)
        # vocabulary ids the tokenizer cannot decode: never sampled (their logits become -inf)
        self.masked_ids = torch.tensor(list(masked_ids), dtype=torch.long) if masked_ids else None
        self.spec = spec  # SpecDecoder when speculative decoding is configured
        self.device_sampling = device_sampling  # here, or in a DP-attention worker
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        # structured outputs: the engine registers a Constraint per constrained request
        self.grammar = None  # GrammarBackend, built on the first constrained request
        self.constraints: dict[str, Constraint] = {}
        self.media: dict[str, PromptMedia] = {}  # prompt media rows per request (multimodal/prompt_media.py)
        self.constraint_stats = ConstraintStats()
        self.static_steps = 0  # steps that ran as the graph backend's static step, here or in a worker

    def constraint(self, so, tokenizer) -> Constraint:
        """A fresh grammar state for one sequence of a request with structured outputs `so`; a
        spec that does not compile is the request's fault (ParamError -> 400), found before
        anything is queued. The grammar compiler is built on the first constrained request."""
        from k3serve.sampling.grammar import GrammarBackend, GrammarError

        if self.grammar is None:
            self.grammar = GrammarBackend(tokenizer, self.vocab_size)
        try:
            return self.grammar.constraint(so)
        except GrammarError as e:
            raise ParamError("structured_outputs", str(e)) from None

    @property
    def taps(self) -> tuple[int, ...]:
        """The layers whose hidden states a DSpark drafter reads after each step."""
        return self.spec.tap_layers if self.spec is not None else ()

    def propose(self, running: list[Request]) -> None:
        """Drafts for the running requests that decode this step (spec_decode/decoder.py)."""
        if self.spec is not None:
            self.spec.propose(running)

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        seqs = batch.seqs
        bounds, pos = [], 0
        for s in seqs:
            bounds.append((pos, pos + s.num_tokens))
            pos += s.num_tokens
        # logits: the last row of sampling sequences, every row of verifying ones
        spans = []  # (seq index, first logits row of it)
        rows: list[int] = []
        for i, (s, (b, e)) in enumerate(zip(seqs, bounds)):
            if s.sample:
                spans.append((i, len(rows)))
                rows += list(range(b, e)) if s.drafts else [e - 1]
        asks = self._prompt_logprob_spans(seqs, bounds)
        media_rows, media_embeds = self._media_rows(seqs)
        sampling = self._fused_sampling(seqs, asks)
        inputs = StepInputs(
            input_ids=[t for s in seqs for t in s.token_ids],
            seq_lens=[s.num_tokens for s in seqs],
            context_lens=[s.start for s in seqs],
            state_slots=[s.state_slot for s in seqs],
            block_tables=[s.block_table for s in seqs],
            block_size=self.plan.block_size,
            verify=[i for i, s in enumerate(seqs) if s.drafts],
            restore=batch.restore_states,
            save=batch.save_states,
            logit_rows=rows,
            prompt_rows=[(b, n) for _, _, b, n in asks],
            media_rows=media_rows,
            media_embeds=media_embeds,
            sampling=sampling,
            draft_rows=_draft_rows(seqs),
            token_mask=self._token_mask(seqs) if sampling is not None else None,
            histories=_histories(seqs) if sampling is not None else None,
        )
        taps = self.taps if self.spec is not None and self.spec.wants_taps(s.request for s in seqs) else ()
        return PreparedStep(batch, inputs, bounds, spans, asks, taps)

    @torch.inference_mode()
    def finish(self, step: PreparedStep, res: StepResult) -> tuple[StepOutput, tuple[list[int], list[int]] | None]:
        """Sample and verify from the step's result: (StepOutput, the (live slots, accepted
        positions) an eager verify pass leaves for the executor to roll back, or None)."""
        seqs, spans, bounds = step.batch.seqs, step.spans, step.bounds
        self.static_steps += res.static
        prompt_lps = self._prompt_logprobs(seqs, step.asks, res.prompt_logits)
        if not spans:
            return StepOutput(prompt_logprobs=prompt_lps), None
        if res.sampled is not None:  # sampled inside the static step: only the ids came back
            out = StepOutput(prompt_logprobs=prompt_lps)
            for s, token, fault in zip(seqs, res.sampled, res.faulty):
                if fault:
                    out.failed[s.request_id] = MODEL_FAULT
                else:
                    out.sampled[s.request_id] = [SampledToken(token)]
            self._advance(out)  # each constrained request's grammar takes its token
            return out, None
        logits = res.logits
        if self.masked_ids is not None:
            logits[:, self.masked_ids] = float("-inf")
        out = StepOutput(prompt_logprobs=prompt_lps)
        plain = [(seqs[i], p) for i, p in spans if not seqs[i].drafts]
        if plain:
            reqs = [s.request for s, _ in plain]
            at = [p for _, p in plain]
            rows = logits if at == list(range(logits.shape[0])) else logits[torch.tensor(at)]  # no copy when all
            self._mask(rows, [(j, self.constraints.get(r.request_id), []) for j, r in enumerate(reqs)])
            sampled = self._sample(rows, reqs)
            out.sampled.update({reqs[j].request_id: [t] for j, t in sampled.tokens.items()})
            out.failed.update({reqs[j].request_id: why for j, why in sampled.failed.items()})
        slots, taus, committed = [], [], {}
        for i, p in spans:
            s, row = seqs[i], bounds[i][1] - 1
            if s.drafts and not res.rows_written:  # the pass's record row j is the j-th verifying
                slots.append(s.state_slot)  # sequence's, whether it verifies or fails (-1: no copy)
                taus.append(-1)
            if s.request_id in out.failed:
                continue
            if s.drafts:
                if any(model_fault_rows(logits[p : p + 1 + len(s.drafts)])):  # NaN / +inf: the model's fault
                    out.failed[s.request_id] = MODEL_FAULT
                    continue
                drafts, c = s.drafts, self.constraints.get(s.request_id)
                if c is not None:  # drafts the grammar refuses are cut, then each position masked
                    drafts = drafts[: c.valid_prefix(drafts)]
                    self.constraint_stats.drafts_cut += len(s.drafts) - len(drafts)
                    self._mask(logits[p : p + 1 + len(drafts)], [(0, c, drafts)])
                try:
                    emitted, tau = self.spec.verify(
                        s.request, logits[p : p + 1 + len(drafts)], drafts, self._generator(s.request)
                    )
                except Exception as e:  # this request's sampling values broke its verify: it fails alone
                    out.failed[s.request_id] = f"speculative verification failed for this request ({type(e).__name__})"
                    continue
                out.sampled[s.request_id] = emitted
                if res.rows_written:  # the state after position tau sits in its own slot: no copy
                    out.accepted[s.request_id] = tau
                else:  # every draft accepted: the live state already is the last position's (-1: no copy)
                    taus[-1] = tau if tau < len(s.drafts) else -1
                row = bounds[i][0] + tau  # the last committed input
            committed[s.request_id] = row
        self._advance(out)
        if step.taps:  # the drafter reads tap-layer states at the last committed position
            states = torch.stack([res.taps[i] for i in step.taps], 1)  # [N, taps, d]
            for rid, row in committed.items():
                self.spec.observe(rid, states[row])
        elif self.taps:  # none captured: what the drafter holds of these requests is stale now
            for rid in committed:
                self.spec.observe(rid, None)
        return out, ((slots, taus) if any(t >= 0 for t in taus) else None)

    def _fused_sampling(self, seqs, asks) -> list[dict] | None:
        """Each row's device sampling values when the whole step can sample inside the static
        step (a pure decode of device-samplable requests asking no logprobs), else None."""
        if not self.device_sampling or asks or not all(s.sample and not s.drafts for s in seqs):
            return None
        reqs = [s.request for s in seqs]
        if not all(device_samplable(r) and r.params.logprobs is None for r in reqs):
            return None
        return [row_values(r, self._seed(r)) for r in reqs]

    def _token_mask(self, seqs) -> torch.Tensor | None:
        """The token bits of a step sampled on the device, xgrammar's layout (int32 [n, ceil(V /
        32)]): each constrained row's grammar mask, each row short of min_tokens without its
        ends, the rest all ones; None when no row is masked."""
        live = [(j, c) for j, s in enumerate(seqs) if (c := self.constraints.get(s.request_id)) and c.active]
        ends = [(j, e) for j, s in enumerate(seqs) if (e := suppressed_ends(s.request))]
        if not live and not ends:
            return None
        bitmask = torch.full((len(seqs), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        for j, c in live:
            c.fill(bitmask, j)
        for j, e in ends:
            refuse(bitmask, j, e)
        self.constraint_stats.masked_rows += len(live)
        return bitmask

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
        """One token per row [B, V]: the host Sampler, and in a device-sampling engine the device
        sampler's draws for the requests it takes (the same draws the static step makes)."""
        dev = [j for j, r in enumerate(reqs) if self.device_sampling and device_samplable(r)]
        if not dev:
            return self.sampler(logits, reqs, [self._generator(r) for r in reqs])
        result = SampleResult()
        host = [j for j in range(len(reqs)) if j not in set(dev)]
        if host:
            sub = self.sampler(
                logits[torch.tensor(host)], [reqs[j] for j in host], [self._generator(reqs[j]) for j in host]
            )
            result.tokens.update({host[k]: t for k, t in sub.tokens.items()})
            result.failed.update({host[k]: why for k, why in sub.failed.items()})
        x = logits[torch.tensor(dev)].float()
        faults = model_faults(x).tolist()
        raw = torch.log_softmax(x, -1) if any(reqs[j].params.logprobs is not None for j in dev) else None
        x = apply_bias_and_penalties(x, [reqs[j] for j in dev])  # min_tokens' ends, as the host Sampler
        ids = sample(x, DeviceSamplingParams.build([row_values(reqs[j], self._seed(reqs[j])) for j in dev])).tolist()
        for k, j in enumerate(dev):
            if faults[k]:
                result.failed[j] = MODEL_FAULT
            else:
                result.tokens[j] = sampled_token(ids[k], raw, k, reqs[j].params.logprobs)
        return result

    @staticmethod
    def _prompt_logprob_spans(seqs, bounds) -> list[tuple[int, int, int, int]]:
        """(seq index, first prompt position, first row, rows) of each chunk whose rows predict
        prompt tokens for a request asking prompt logprobs: row p predicts prompt token p + 1."""
        out = []
        for i, (s, (b, _)) in enumerate(zip(seqs, bounds)):
            last = min(s.start + s.num_tokens, len(s.request.prompt_token_ids) - 1)
            if s.request.params.prompt_logprobs is not None and s.start < last:
                out.append((i, s.start, b, last - s.start))
        return out

    @staticmethod
    def _prompt_logprobs(seqs, asks, logits: list[torch.Tensor]) -> dict[str, dict[int, PromptLogprob]]:
        """Each span's log-softmax (raw model logits, fp32) gives its prompt tokens' logprobs and the top-n."""
        out = {}
        for (i, start, _, n), rows in zip(asks, logits):
            s = seqs[i]
            n_top = s.request.params.prompt_logprobs
            lsm = torch.log_softmax(rows, -1)  # [n, V]
            targets = torch.tensor(s.request.prompt_token_ids[start + 1 : start + 1 + n])
            own = lsm.gather(1, targets[:, None])  # [n, 1]
            ranks = ((lsm > own).sum(-1) + 1).tolist()
            tops = lsm.topk(n_top, -1) if n_top else None
            entries = {}
            for j, (tok, lp) in enumerate(zip(targets.tolist(), own[:, 0].tolist())):
                top = () if tops is None else tuple(zip(tops.indices[j].tolist(), tops.values[j].tolist()))
                entries[start + 1 + j] = PromptLogprob(tok, lp, ranks[j], top)
            out[s.request_id] = entries
        return out

    def _media_rows(self, seqs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Flat batch rows of this step's media pads and the tower rows they take: a prefill
        chunk may end inside a media block, each chunk takes the rows of the pads it holds."""
        rows, values, offset = [], [], 0
        for s in seqs:
            m = self.media.get(s.request_id)
            if m is not None and len(m.positions):
                inside = (m.positions >= s.start) & (m.positions < s.start + s.num_tokens)
                rows.append(m.positions[inside] - s.start + offset)
                values.append(m.embeds[inside])
            offset += s.num_tokens
        if not rows:
            return None, None
        return torch.cat(rows).to(self.device), torch.cat(values).to(self.device)

    def _mask(self, logits: torch.Tensor, rows: list[tuple[int, "Constraint | None", list[int]]]) -> None:
        """Grammar bitmasks on `logits` (in place): (first row, constraint, drafts after it)."""
        # a row set with drafts is masked even while its constraint is still free: the drafts can
        # open the constrained span (a think channel closing), and the positions after that are
        # masked like any other (fill_drafts leaves the free positions all-allowed)
        live = [(r, c, d) for r, c, d in rows if c is not None and (c.active or d)]
        if not live:
            return
        bitmask = self.grammar.allocate(logits.shape[0])
        for r, c, drafts in live:
            c.fill_drafts(bitmask, r, drafts)
        self.grammar.apply(logits, bitmask)
        self.constraint_stats.masked_rows += len(live)

    def _advance(self, out: StepOutput) -> None:
        """Each constrained request's grammar takes the tokens it emitted this step."""
        for rid, toks in out.sampled.items():
            c = self.constraints.get(rid)
            if c is None:
                continue
            for t in toks:
                if not c.accept(t.token_id):  # masked sampling cannot pick it; a bug if it does
                    out.failed[rid] = f"token {t.token_id} broke this request's output grammar"
                    break

    def release(self, request_id: str) -> None:
        self.constraints.pop(request_id, None)
        self.media.pop(request_id, None)
        self._generators.pop(request_id, None)
        if self.spec is not None:
            self.spec.release(request_id)

    def rng_state(self, request_id: str) -> torch.Tensor | None:
        """A request's sampler generator state (a prefill/decode hand-off carries it)."""
        gen = self._generators.get(request_id)
        return None if gen is None else gen.get_state()

    def restore_rng(self, req: Request, state: torch.Tensor) -> None:
        self._generator(req).set_state(state)

    def _seed(self, req: Request) -> int:
        """The request's seed; unseeded: still deterministic for a given engine seed and arrival order."""
        return request_seed(req.params.seed, req.arrival, self.seed)

    def _generator(self, req: Request) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator().manual_seed(self._seed(req))
        return gen


def speculation(config, model_path: str, target, max_model_len: int, device):
    """The SpecDecoder of an EngineConfig's `speculative_config`, or None. Its drafter reads the
    target's config (`target`: the model, or executor/base.py ModelInfo when the model lives in
    worker processes), and its kernels when the model is in this process."""
    if not config.speculative_config:
        return None
    from k3serve.config.speculative import SpeculativeConfig
    from k3serve.spec_decode.decoder import SpecDecoder

    spec_cfg = SpeculativeConfig.from_dict(config.speculative_config).resolve_model(model_path)
    spec = SpecDecoder(spec_cfg, target, max_model_len, config.max_num_seqs, device)
    log.info(
        "speculative decoding: %s, %d tokens, %s drafting, %s verification",
        spec.cfg.method,
        spec.cfg.num_speculative_tokens,
        spec.cfg.draft_sample_method,
        spec.cfg.rejection_sample_method,
    )
    return spec


def _draft_rows(seqs) -> list[list[int]] | None:
    """A verify step's slot rows (cache/draft_slots.py), when every verifying sequence has one."""
    rows = [s.draft_row for s in seqs if s.drafts]
    return [s.draft_row for s in seqs] if rows and len(rows) == len(seqs) and None not in rows else None


def _histories(seqs) -> list[tuple[list[int], list[int]]] | None:
    """Each row's (prompt, output) ids for the penalties of a step sampled on the device, or
    None when no row uses penalties (rows that do not: empty lists)."""
    if not any(s.request.params.uses_penalties for s in seqs):
        return None
    return [
        (s.request.prompt_token_ids, s.request.output_token_ids) if s.request.params.uses_penalties else ([], [])
        for s in seqs
    ]
