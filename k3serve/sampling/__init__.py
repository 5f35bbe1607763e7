"""Sampling: parameters (pure Python), the batched sampler and the incremental detokenizer."""

from k3serve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
