"""Lightning callbacks: MemOpt and its parts."""

from lightning_memopt.callbacks.memopt import MemOpt
from lightning_memopt.callbacks.peak import PeakMemory
from lightning_memopt.engine.report import Applied, MemOptReport

__all__ = ["Applied", "MemOpt", "MemOptReport", "PeakMemory"]
