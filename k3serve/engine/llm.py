"""Offline API in the shape vLLM users know:

llm = k3serve.LLM(model, max_model_len=..., max_num_seqs=..., cache_memory="1GiB", seed=0)
outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
outs[0].outputs[0].token_ids, outs[0].outputs[0].text
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from k3serve.engine.llm_engine import LLMEngine, PromptInput
from k3serve.outputs import RequestOutput
from k3serve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        """`data_parallel_size` > 1: replicas of the engine (engine/dp_llm_engine.py)."""
        dp = engine_kwargs.pop("data_parallel_size", 1)
        if dp == 1:
            self.engine = LLMEngine.from_args(model, **engine_kwargs)
        else:
            from k3serve.engine.dp_llm_engine import DataParallelEngine

            if not isinstance(dp, int) or dp < 1:
                raise ValueError(f"data_parallel_size must be an int >= 1, got {dp!r}")
            self.engine = DataParallelEngine(model, dp, **engine_kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """All prompts run together under continuous batching; results in input order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
