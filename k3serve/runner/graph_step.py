"""GraphSteps: the `graph` backend's decode step, compiled once per batch bucket and, on CUDA,
captured as a CUDA graph (nano-vllm `capture_cudagraph`, vLLM `CUDAGraphRunner`).

A pure decode step (every row one token of a running sequence: no prefill, verify, media or
prompt logprobs) of n rows runs in the smallest capture size B >= n, with a block-table width
W rounded up to a power of two (the MLA context gather is [B, W * block_size]; a Triton paged
kernel will drop W from the key). Per (B, W): persistent `StaticBuffers`, a function compiled
with `fullgraph=True, dynamic=False` (its own code object, so buckets never count as each
other's recompiles), and on CUDA a graph captured after warm-up on padding rows only (scratch
slot and block: capture never touches live state). A step: one host-to-device copy of the
inputs, the compiled call or a replay, one device-to-host copy of the [n, V] logits.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from k3serve.config.compilation import CompilationConfig
from k3serve.forward import CacheTensors, StaticBuffers


def static_forward(model, step, cache, taps):
    """The whole static step: layers (the graph backend's fixed-shape paths) and the logits.
    Returns fp32 logits [B, V] and the tap layers' hidden states {layer: [B, d]}."""
    out = model(step.expand(), cache, taps)
    return model.compute_logits(out.hidden), out.taps


@dataclass
class GraphSettings:
    """What the engine hands the runner for the graph backend (EngineConfig's flags)."""

    config: CompilationConfig
    max_num_seqs: int
    eager: bool = False  # --enforce-eager


@dataclass
class _Entry:
    buffers: StaticBuffers
    run: object  # () -> (logits, taps): the compiled call, or a graph replay returning its outputs


class GraphSteps:
    def __init__(self, model, cache: CacheTensors, device: torch.device, config: CompilationConfig,
                 max_num_seqs: int, eager: bool = False):
        """`eager` (--enforce-eager): the static step runs uncompiled and uncaptured."""
        if cache.scratch_slot is None:
            raise ValueError("the graph backend needs a cache allocated with a scratch slot and block")
        self.model, self.cache, self.device, self.config, self.eager = model, cache, device, config, eager
        self.sizes = config.capture_sizes(max_num_seqs)
        self.entries: dict[tuple, _Entry] = {}
        self.pool = None  # CUDA graphs of every bucket share one memory pool
        self.compiles = 0  # entries built (each a compile and, on CUDA, a capture)
        self.steps = 0  # decode steps run here

    def takes(self, inp) -> bool:
        """Whether a step is a pure decode the static step runs."""
        n = len(inp.seq_lens)
        return (0 < n <= self.sizes[-1] and not inp.verify and inp.media_rows is None and not inp.prompt_rows
                and all(s == 1 for s in inp.seq_lens) and all(c > 0 for c in inp.context_lens)
                and inp.logit_rows == list(range(n)))

    def bucket(self, n: int, tables: list[list[int]]) -> tuple[int, int]:
        B = next(s for s in self.sizes if s >= n)
        need = max(len(t) for t in tables)
        return B, 1 << max(0, (need - 1).bit_length())

    def run(self, inp, taps: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """fp32 logits [n, V] on the CPU and the taps [n, d] of a step `takes` accepted."""
        n = len(inp.seq_lens)
        B, W = self.bucket(n, inp.block_tables)
        entry = self.entries.get((B, W, taps))
        if entry is None:
            entry = self.entries[(B, W, taps)] = self._build(B, W, taps)
        self.steps += 1
        entry.buffers.fill(inp.input_ids, inp.state_slots, inp.context_lens, inp.block_tables)
        logits, tapped = entry.run()
        return logits[:n].cpu(), {i: t[:n] for i, t in tapped.items()}

    def _build(self, B: int, W: int, taps: tuple[int, ...]) -> _Entry:
        self.compiles += 1
        buffers = StaticBuffers(B, W, self.cache.block_size, self.device, self.cache.scratch_slot,
                                self.cache.scratch_block)
        fn = types.FunctionType(static_forward.__code__.replace(), static_forward.__globals__,
                                f"static_forward_b{B}_w{W}")
        if not self.eager:
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.config.backend)
        model, step, cache = self.model, buffers.step, self.cache

        def call():
            return fn(model, step, cache, taps)
        if self.eager or self.device.type != "cuda":
            return _Entry(buffers, call)
        return _Entry(buffers, self._capture(call))

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
        with torch.cuda.graph(graph, pool=self.pool):
            out = call()
        self.pool = graph.pool()

        def replay():
            graph.replay()
            return out
        return replay
