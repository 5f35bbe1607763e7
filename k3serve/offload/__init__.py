"""The prefix cache's host-memory and disk tiers (issue 49): `store.PrefixTiers` moves latent
blocks and KDA states between the device pools, host memory and files; `entry` is the file
format (safetensors with a checksum and the model's fingerprint). The index of what each tier
holds is cache/tiers.py (torch-free, consulted by the scheduler's bookkeeping)."""
