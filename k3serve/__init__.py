"""k3serve: an inference and serving engine for Kimi-K3-class models.

`k3serve.LLM` and `k3serve.SamplingParams` are the offline API; they load lazily so that the
pure-Python parts (config, cache bookkeeping, scheduler) never pull in torch.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from k3serve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from k3serve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'k3serve' has no attribute {name!r}")
