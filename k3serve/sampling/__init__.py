"""Sampling: the batched sampler, device sampling, logits processing, grammars and speculative
verification's draws (the request's parameters are k3serve/sampling_params.py)."""
