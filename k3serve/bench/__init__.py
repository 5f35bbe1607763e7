"""`k3serve bench`: an OpenAI-endpoint load generator with vLLM `bench serve` metrics and
matched A/B ablations (replaying identical token ids and sampling parameters)."""
