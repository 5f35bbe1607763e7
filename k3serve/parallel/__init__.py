"""What the model's layers use to run split over ranks: tensor-parallel groups and their
collectives (group.py: gloo / NCCL, functional collectives inside a compiled step), the
shared-memory collectives of ranks on one host (shm.py), the expert group of DP-attention +
expert parallelism (expert_group.py) and how weights shard (shard.py). It imports no model,
runner or engine; starting and driving the rank processes is k3serve/distributed/."""
