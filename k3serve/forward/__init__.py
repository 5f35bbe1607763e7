"""The step's data between the runner and the layers: what to compute (ForwardBatch, StepRows),
where state lives (CacheTensors) and what comes back (ForwardOut). Imported by layers/ and
models/; imports neither runner/ nor engine/."""

from k3serve.forward.batch import RECORDS_IN_FLIGHT, SHORT_PREFILL, ForwardBatch, StepRows
from k3serve.forward.cache import CacheTensors
from k3serve.forward.out import ForwardOut
from k3serve.forward.static import StaticBuffers, StaticStep

__all__ = [
    "RECORDS_IN_FLIGHT",
    "SHORT_PREFILL",
    "CacheTensors",
    "ForwardBatch",
    "ForwardOut",
    "StaticBuffers",
    "StaticStep",
    "StepRows",
]
