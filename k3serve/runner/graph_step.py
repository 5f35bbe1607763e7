"""GraphSteps: the `graph` backend's decode and verify steps, compiled once per batch bucket and,
on CUDA, captured as a CUDA graph (nano-vllm `capture_cudagraph`, vLLM `CUDAGraphRunner`).

A pure decode step (every row one token of a running sequence: no prefill, media or prompt
logprobs), or a speculative verify pass of every sequence (1 + k positions each, fewer drafts
padded), of n sequences runs in the smallest capture size B >= n, with a block-table width W
rounded up to a power of two (the MLA context gather is [N, W * block_size]; a Triton paged
kernel will drop W from the key). Per (B, W, T): persistent `StaticBuffers`, a function compiled
with `fullgraph=True, dynamic=False` (its own code object, so buckets never count as each
other's recompiles), and on CUDA a graph captured after warm-up on padding rows only (scratch
slot and block: capture never touches live state). A step: one host-to-device copy of the
inputs, the compiled call or a replay, one device-to-host copy of the [n, V] logits.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import types
import weakref
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from k3serve.backends import STATIC
from k3serve.config.compilation import CompilationConfig
from k3serve.forward import CacheTensors, StaticBuffers
from k3serve.runner.compile_thread import compile_loop, count
from k3serve.runner.graph_stages import received, report, static_stage
from k3serve.sampling.device import NEG_INF, allowed_tokens, model_faults, sample

log = logging.getLogger("k3serve.graph")

# DP-attention: how long a step's collectives wait while a peer compiles a new bucket (its first
# call compiles the whole step: minutes for a large model on a few cores)
COMPILE_TIMEOUT_S = 1800.0


def static_forward(model, step, cache, taps):
    """The whole static step: layers (the graph backend's fixed-shape paths) and the logits.
    Returns fp32 logits [N, V] and the tap layers' hidden states {layer: [N, d]} in the flat
    batch's row order (a verify step's static rows gathered back; padding rows after), and a
    batch's row order (a verify step's static rows gathered back; padding rows after). A verify
    step writes each position's KDA state to its slot row (cache/draft_slots.py): no records."""
    step = step.expand()
    out = model(step, cache, taps)
    if step.T == 1:
        return model.compute_logits(out.hidden), out.taps
    taps_out = {i: t[step.gather] for i, t in out.taps.items()}
    return model.compute_logits(out.hidden[step.gather]), taps_out


def static_sample(model, step, cache, taps, bias):
    """The static step with sampling on the device (sampling/device.py): the sampled ids [B],
    the rows whose logits were the model's fault [B] (NaN, +inf, nothing finite) and the taps.
    `bias` [1, V]: -inf at the vocabulary ids the tokenizer cannot decode, or None. A bucket with
    grammar masks (`step.token_mask`) samples each row among its allowed tokens."""
    logits, taps_out = static_forward(model, step, cache, taps)
    if bias is not None:
        logits = logits + bias
    faults = model_faults(logits)  # the model's own fault, before any grammar's -inf
    if step.token_mask is not None:
        logits = logits.masked_fill(~allowed_tokens(step.token_mask, logits.shape[1]), NEG_INF)
    counts, seen = step.penalty_counts(logits.shape[1])  # None without penalties
    return sample(logits, step.sampling_params(), counts=counts, prompt_mask=seen), faults, taps_out


@dataclass
class GraphOut:
    """What a static step hands back, on the CPU: logits [n, V], or with device sampling the
    sampled ids and model-fault flags [n] (then the step's only device-to-host copy)."""

    logits: torch.Tensor | None
    ids: list[int] | None
    faults: list[bool] | None
    taps: dict[int, torch.Tensor]


@dataclass
class GraphSettings:
    """What the engine hands the runner for the graph backend (EngineConfig's flags)."""

    config: CompilationConfig
    max_num_seqs: int
    eager: bool = False  # --enforce-eager
    num_speculative_tokens: int = 0  # k: verify steps run as 1 + k positions a sequence

    def startup_line(self, device: torch.device, lockstep: bool) -> str:
        cc = self.config
        sizes = cc.capture_sizes(self.max_num_seqs)
        line = (
            f"graph backend: decode steps of {sizes[0]}..{sizes[-1]} rows run compiled "
            f"({'eager, --enforce-eager' if self.eager else cc.backend}"
            f"{', captured as CUDA graphs' if device.type == 'cuda' and not self.eager else ''}); "
            + (
                "each new batch bucket compiles on a thread of its own, its steps eager until then"
                if cc.compile_in_background and not self.eager and not lockstep
                else "each new batch bucket compiles on its first step"
            )
            + f" (at most {cc.max_compiled_buckets} buckets)"
            + ("; DP-attention ranks agree on each step's bucket" if lockstep else "")
        )
        if cc.extra:
            line += f"; compilation-config keys without effect here: {', '.join(sorted(cc.extra))}"
        return line


def graph_settings(config, mode: str, spec) -> GraphSettings | None:
    """The static decode step of an engine whose backend `mode` is graph or triton, else None
    (`config`: EngineConfig; `spec`: its SpecDecoder or None)."""
    if mode not in STATIC:
        return None
    k = spec.cfg.num_speculative_tokens if spec is not None else 0
    return GraphSettings(config.compilation_config, config.max_num_seqs, config.enforce_eager, k)


class Bucket(NamedTuple):
    """What one compiled (and captured) static step is built for."""

    B: int  # sequences
    W: int  # block-table width
    T: int  # positions a sequence: 1 decode, 1 + k verify
    taps: tuple[int, ...]  # the layers whose hidden states come back (a DSpark drafter's)
    sampled: bool  # sampling inside the step (ids back), else logits back
    masked: bool  # its steps carry grammar masks (StaticStep.token_mask)
    history: tuple[int, int]  # penalties: the prompt and output widths (powers of two), else (0, 0)
    ep_rows: int  # DP-attention: the rows its MoE layers exchange (`decide`), else 0


@dataclass
class _Entry:
    buffers: StaticBuffers
    run: object  # () -> (logits, taps): the compiled call, or a graph replay returning its outputs
    captured: bool = False  # a CUDA graph replay: its outputs are overwritten by the next replay


class GraphSteps:
    def __init__(
        self,
        model,
        cache: CacheTensors,
        device: torch.device,
        config: CompilationConfig,
        max_num_seqs: int,
        eager: bool = False,
        masked_ids: list[int] = (),
        num_speculative_tokens: int = 0,
    ):
        """`eager` (--enforce-eager): the static step runs uncompiled and uncaptured.
        `masked_ids`: vocabulary ids never sampled (the tokenizer cannot decode them)."""
        if cache.scratch_slot is None:
            raise ValueError("the graph backend needs a cache allocated with a scratch slot and block")
        self.model, self.cache, self.device, self.config, self.eager = model, cache, device, config, eager
        model.tp.enable_functional()  # its collectives become graph nodes (parallel/group.py)
        self.ep = model.ep  # DP-attention's expert group: its ranks agree on each step (`decide`)
        # pipeline stages: each rank runs its stage's layers static, the hand-offs between the
        # calls (`run`); every stage takes the same bucket, from the same StepInputs
        self.pipe = model.pipe
        if self.ep is not None:
            self.ep.enable_functional()
        self.sizes = config.capture_sizes(max_num_seqs)
        self.verify_positions = 1 + num_speculative_tokens if num_speculative_tokens else 0
        self.bias = None
        if masked_ids:
            self.bias = torch.zeros(1, model.cfg.vocab_size, device=device)
            self.bias[0, torch.tensor(list(masked_ids), device=device)] = float("-inf")
        self.entries: dict[Bucket, _Entry] = {}
        self.pool = None  # CUDA graphs of every bucket share one memory pool
        self.compiles = 0  # entries built (each a compile and, on CUDA, a capture)
        self.steps = 0  # decode and verify steps run here
        self.padding_steps = 0  # DP-attention: static steps of padding rows only, for an idle rank
        self.eager_steps = 0  # steps static would take, run eagerly: their bucket compiling or over the cap
        # a single rank compiles new buckets off the step path; a TP or DP-attention group's ranks
        # must take the same path each step, so they build in the step, as they agree
        self.background = (
            config.compile_in_background and not eager and self.ep is None and model.tp.size == 1 and self.pipe is None
        )
        self._building: dict[Bucket, Future] = {}  # bucket -> its background build
        self._failed: set[Bucket] = set()  # builds that raised: those steps stay eager
        self._jobs: queue.Queue | None = None  # the compile thread's queue, started on first use
        self._capped = False  # the cap was reached (warned once)

    def takes(self, inp) -> bool:
        """Whether a step is one the static step runs: a pure decode (one token a sequence), or a
        verify pass of every sequence (1 + drafts tokens each, at most 1 + k), every row sampled."""
        n = len(inp.seq_lens)
        if not (
            0 < n <= self.sizes[-1]
            and inp.media_rows is None
            and not inp.prompt_rows
            and all(c > 0 for c in inp.context_lens)
            and inp.logit_rows == list(range(sum(inp.seq_lens)))
        ):
            return False
        if not inp.verify:
            return all(s == 1 for s in inp.seq_lens)
        # a verify pass writes each position's state to the sequence's slot row: it needs the rows,
        # and a checkpoint save (the state after every draft) stays on the eager path's records
        return (
            inp.verify == list(range(n))
            and max(inp.seq_lens) <= self.verify_positions
            and inp.draft_rows is not None
            and all(r is not None and len(r) == self.verify_positions for r in inp.draft_rows)
            and not inp.save
        )

    def bucket(self, n: int, tables: list[list[int]]) -> tuple[int, int]:
        B = next(s for s in self.sizes if s >= n)
        need = max(len(t) for t in tables)
        return B, _pow2(need)

    def _key(self, inp, taps: tuple[int, ...], ep_rows: int) -> Bucket:
        B, W = self.bucket(len(inp.seq_lens), inp.block_tables)
        history = (0, 0)
        if inp.histories is not None:  # widths as powers of two: a bucket per doubling, not per token
            history = tuple(_pow2(max(len(h[i]) for h in inp.histories)) for i in (0, 1))
        return Bucket(
            B, W, self._positions(inp), taps, inp.sampling is not None, inp.token_mask is not None, history, ep_rows
        )

    def _ready(self, key: Bucket) -> bool:
        """Whether a step of this bucket runs static now (False: eagerly). A bucket not built yet
        is queued for the compile thread (background) or built by `run` (in the step), unless
        the cap on compiled buckets is reached."""
        if key in self.entries:
            return True
        fut = self._building.get(key)
        if fut is not None and fut.done():
            del self._building[key]
            if fut.exception() is None:
                self.entries[key] = fut.result()
                return True
            log.warning("graph backend: compiling %s raised %r; its steps run eagerly", key, fut.exception())
            self._failed.add(key)
        if fut is not None or key in self._failed:
            return False
        if len(self.entries) + len(self._building) >= self.config.max_compiled_buckets:
            if not self._capped:
                self._capped = True
                log.warning(
                    "graph backend: %d buckets compiled (compilation_config.max_compiled_buckets): "
                    "steps of new buckets run eagerly",
                    self.config.max_compiled_buckets,
                )
            return False
        if not self.background:
            return True
        if self._jobs is None:
            self._jobs = queue.Queue()
            threading.Thread(target=compile_loop, args=(self._jobs,), name="k3serve-compile").start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with its GraphSteps
        self._building[key] = Future()
        count(1)
        self._jobs.put((weakref.WeakMethod(self._warm), key, self._building[key]))  # dropped with its GraphSteps
        return False

    def _warm(self, key: Bucket) -> _Entry:
        """Build a bucket and run it once on padding rows (the compile and, on CUDA, the capture
        happen there): on the compile thread, while the engine's steps run eagerly."""
        with torch.inference_mode():
            entry = self._build(*key)
            entry.buffers.fill_padding()
            entry.run()
        return entry

    def decide(self, inp, taps: tuple[int, ...] = ()) -> int | None:
        """Whether this step runs static: None for the eager path, else its `ep_rows` (0 without
        DP-attention). `inp` None: a DP-attention rank with nothing scheduled. DP-attention
        ranks meet in every MoE layer, so all of them run static or none does: each offers the
        rows B * T of its bucket (-1: it cannot, 0: idle) in one small all-gather before the
        forward, and a static step exchanges the largest offer's rows with every rank (an idle
        rank runs a padding step of them: `run_padding`). vLLM's `coordinate_batch_across_dp`
        and SGLang's DP-attention CUDA-graph check agree the same way."""
        takes = inp is not None and self.takes(inp)
        if takes and not self._ready(self._key(inp, taps, 0) if self.ep is None else self._key(inp, taps, -1)):
            self.eager_steps += 1
            takes = False
        if self.ep is None:
            return 0 if takes else None
        if inp is None:
            offer = 0
        elif takes:
            offer = self.bucket(len(inp.seq_lens), inp.block_tables)[0] * self._positions(inp)
        else:
            offer = -1
        offers = [int(v) for v in self.ep.all_gather(torch.tensor([float(offer)]))]  # [M] on the CPU: a host value
        return max(offers) if min(offers) >= 0 and max(offers) > 0 else None

    def _positions(self, inp) -> int:
        return self.verify_positions if inp.verify else 1

    def run(self, inp, taps: tuple[int, ...], ep_rows: int = 0, defer: bool = False):
        """A step `takes` accepted: its logits, or with `inp.sampling` its sampled ids.
        `ep_rows`: DP-attention's agreed exchange rows (`decide`). Under pipeline stages every
        rank runs its stage; the driver's GraphOut carries what the later stages sent it, the
        other ranks' is empty, and with `defer` the driver returns once its stage has sent its
        rows on, with a callable that receives the rest (RankRunner.forward)."""
        key = self._key(inp, taps, ep_rows)
        new = key not in self.entries
        with self._patient(new):
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = self._build(*key)
            self.steps += 1
            slots = inp.draft_rows if inp.verify else inp.state_slots
            entry.buffers.fill(
                inp.input_ids,
                inp.seq_lens,
                slots,
                inp.context_lens,
                inp.block_tables,
                inp.sampling,
                inp.token_mask,
                inp.histories,
            )
            pipe = self.pipe
            if pipe is None:
                return self._out(inp, entry.run())
            if not pipe.stage.first:  # the previous stage's rows, into the step's input buffer
                pipe.receive_into(entry.buffers.step.incoming)
            out = entry.run()
            if not pipe.stage.last:  # still being sent when the next replay writes a captured output
                pipe.send_stacked(out[0].clone() if entry.captured else out[0])
            if pipe.rank != 0:
                report(pipe, inp, out)
                return GraphOut(None, None, None, {})
            if defer:  # received in step order (collect), patient while the later stages compile
                return lambda: self._from_stages(inp, out, taps, new)
        return self._from_stages(inp, out, taps, new)

    def _from_stages(self, inp, out, taps: tuple[int, ...], new: bool) -> GraphOut:
        """The driver: what the later stages reported (`new`: the step built its bucket, which
        they compile before they answer)."""
        with self._patient(new):
            return GraphOut(*received(self.pipe, self.model, inp, out, taps))

    def _out(self, inp, out) -> GraphOut:
        """The last stage's outputs (logits / sampled ids and faults, taps) as a GraphOut."""
        n, rows = len(inp.seq_lens), sum(inp.seq_lens)
        if inp.sampling is not None:
            ids, faults = torch.stack((out[0], out[1].long()))[:, :n].tolist()  # one copy back
            return GraphOut(None, ids, [bool(f) for f in faults], {i: t[:n] for i, t in out[2].items()})
        return GraphOut(out[0][:rows].cpu(), None, None, {i: t[:rows] for i, t in out[1].items()})

    def run_padding(self, ep_rows: int) -> None:
        """A DP-attention rank with nothing scheduled, when its peers run static: the smallest
        bucket's step on padding rows only (scratch slot and block), whose MoE layers exchange
        `ep_rows` rows like theirs. Its logits are dropped."""
        key = Bucket(self.sizes[0], 1, 1, (), False, False, (0, 0), ep_rows)
        with self._patient(key not in self.entries):
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = self._build(*key)
            entry.buffers.fill_padding()  # a live step of the same bucket may have filled them last
            entry.run()
        self.padding_steps += 1

    @contextmanager
    def _patient(self, new: bool):
        """DP-attention: a rank's first call of a new bucket compiles it, and its peers wait for
        that inside the step's collectives. The ranks say whether any of them builds a new bucket
        (one more small all-gather, before anyone builds), and if one does, every rank's gloo
        groups wait up to COMPILE_TIMEOUT_S in this step instead of --distributed-timeout."""
        if self.ep is None and (self.pipe is None or not new):
            yield
            return
        # every pipeline stage builds the same new bucket in the same step (no all-gather needed):
        # a stage waits in its receive while the one before it compiles
        if self.ep is not None and not max(int(v) for v in self.ep.all_gather(torch.tensor([float(new)]))):
            yield
            return
        groups = [g.pg for g in (self.ep, self.model.tp) if g is not None and g.size > 1 and g.pg is not None]
        pgs = groups + ([self.pipe.pg] if self.pipe is not None else [])
        before = [pg.options._timeout for pg in pgs]
        for pg, t in zip(pgs, before):
            pg._set_default_timeout(max(t, datetime.timedelta(seconds=COMPILE_TIMEOUT_S)))
        try:
            yield
        finally:
            for pg, t in zip(pgs, before):
                pg._set_default_timeout(t)

    def _build(self, B, W, T, taps, sampled, masked, history, ep_rows) -> _Entry:
        self.compiles += 1
        V = self.model.cfg.vocab_size
        cache = self.cache
        staged = self.pipe is not None
        incoming = None
        if staged and not self.pipe.stage.first:  # the previous stage's [bank + 1, N, d]
            incoming = (self.pipe.bank_size + 1, self.model.cfg.hidden_size, self.model.dtype)
        buffers = StaticBuffers(
            B, W, cache.block_size, self.device, cache.scratch_slot, cache.scratch_block, T, ep_rows,
            -(-V // 64) if masked else 0, history, V, incoming,
        )  # fmt: skip
        last = not staged or self.pipe.stage.last
        body = (static_sample if sampled else static_forward) if last else static_stage
        name = f"{body.__name__}_b{B}_w{W}_t{T}" + ("_masked" if masked else "") + (f"_ep{ep_rows}" if ep_rows else "")
        name += f"_h{history[0]}x{history[1]}" if history[1] else ""
        fn = types.FunctionType(body.__code__.replace(), body.__globals__, name)
        if not self.eager:
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.config.backend)
        if staged:  # the tap layers this stage holds
            taps = tuple(i for i in taps if self.pipe.stage.holds(i))
        args = (self.model, buffers.step, self.cache, taps) + ((self.bias,) if sampled and last else ())

        def call():
            return fn(*args)

        if self.eager or self.device.type != "cuda":
            return _Entry(buffers, call)
        return _Entry(buffers, self._capture(call), captured=True)

    def _capture(self, call):
        """Warm up on a side stream (the compile happens there), then capture one replayable graph;
        the buffers hold padding rows only, so neither touches live state."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                call()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # on the compile thread the engine's thread launches work meanwhile: only this thread's
        # calls are checked for capture safety (the default, "global", fails the other thread's)
        mode = "thread_local" if self.background else "global"
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
            out = call()
        self.pool = graph.pool()

        def replay():
            graph.replay()
            return out

        return replay


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
