"""Host-sync audits without a GPU (gpu-design.md, "FakeTensorMode with fake cuda tensors").

`SyncAudit` is a dispatch mode that records every aten op and each op mixing host and device
tensors (a copy across, or a host index into a device tensor: the implicit upload a GPU waits
for). Run a step under FakeTensorMode on a fake device: data-dependent ops (`.item()`,
`.tolist()`, `nonzero`, `bincount`) raise there, the rest are seen here.

`fake_gpu()` names the device: a PrivateUse1 backend with Python hooks. Fake "cuda" tensors
serve calls that never index from Python; indexing takes a CUDA device guard, which a CPU-only
torch build cannot give, so a whole model step needs this device instead.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op names that wait for device data on the host, or whose output shape depends on it
HOST_SYNC_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "bincount",
    "unique",
    "masked_select",
    "item",
    "repeat_interleave.Tensor",
)


class SyncAudit(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.cross: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if "device" in kwargs and tensors and torch.device(kwargs["device"]).type not in devices:
            self.cross.append(str(func))
        elif len({t.device.type for t in tensors if t.dim() or t.device.type != "cpu"}) > 1:
            self.cross.append(str(func))  # CPU 0-dim scalars are arguments, not transfers
        return func(*args, **kwargs)

    @property
    def syncs(self) -> list[str]:
        return [op for op in self.ops if any(k in op for k in HOST_SYNC_OPS)]


def fake_gpu() -> str:
    """The audit's accelerator device name, registered once per process. Its module says it is
    not available and has no devices: FakeTensorMode does not ask, while code that looks for a
    usable accelerator (torch.accelerator.is_available(), RNG-state helpers) keeps seeing none."""
    from torch.utils import backend_registration

    class Unavailable(backend_registration._DummyBackendModule):
        def is_available(self) -> bool:
            return False

        def device_count(self) -> int:
            return 0

    if torch._C._get_privateuse1_backend_name() != "fakegpu":
        backend_registration._setup_privateuseone_for_python_backend("fakegpu", backend_module=Unavailable())
    return "fakegpu"
