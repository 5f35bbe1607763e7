"""What the prefix cache's host-memory and disk tiers hold (`k3serve plan --kv-offloading-size
GiB --kv-offloading-dir-size GiB`, issue 49): an entry per 16-token block of latent rows, and
the KDA state (recurrent + conv, every KDA layer) at each checkpoint, so a conversation whose
prefix is P tokens with one checkpoint per turn takes P x latent bytes per token + turns x
state bytes (k3serve/offload: each rank stores its own shard; these are one instance's bytes,
the latent counted once)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 2**30


@dataclass(frozen=True)
class TierCapacity:
    host_bytes: int
    disk_bytes: int
    prefix_tokens: int  # a conversation's reusable prefix
    checkpoints: int  # KDA states kept per conversation (one per turn)
    bytes_per_conversation: int

    @property
    def host_conversations(self) -> int:
        return self.host_bytes // self.bytes_per_conversation

    @property
    def disk_conversations(self) -> int:
        return self.disk_bytes // self.bytes_per_conversation

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "host_conversations": self.host_conversations,
            "disk_conversations": self.disk_conversations,
        }

    def line(self) -> str:
        return (
            f"prefix-cache tiers: a conversation of {self.prefix_tokens:,} prefix tokens and {self.checkpoints} "
            f"KDA checkpoints is {self.bytes_per_conversation / 2**20:,.1f} MiB; host memory "
            f"{self.host_bytes / GiB:g} GiB holds {self.host_conversations:,}, the directory "
            f"{self.disk_bytes / GiB:g} GiB {self.disk_conversations:,}"
        )


def tier_capacity(
    token_bytes: int, state_bytes: int, prefix_tokens: int, checkpoints: int, host_gib: float, disk_gib: float
) -> TierCapacity:
    per = prefix_tokens * token_bytes + checkpoints * state_bytes
    return TierCapacity(int(host_gib * GiB), int(disk_gib * GiB), prefix_tokens, checkpoints, per)
