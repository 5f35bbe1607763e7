"""Executors: one replica's ranks behind one interface (executor/base.py)."""

from k3serve.executor.base import RANK_FAULTS, Allocation, Executor, ModelInfo, WorkerDied
from k3serve.executor.uniproc import UniProcExecutor

__all__ = ["RANK_FAULTS", "Allocation", "Executor", "ModelInfo", "UniProcExecutor", "WorkerDied"]
