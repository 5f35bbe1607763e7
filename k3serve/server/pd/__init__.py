"""Prefill/decode disaggregation: the KV hand-off between servers (HTTP and NIXL), its
endpoints, and the proxy (`k3serve router`) in front of prefill and decode servers."""
