"""Lightning callbacks."""

from lightning_memopt.callbacks.memopt import Applied, MemOpt
from lightning_memopt.callbacks.peak import PeakMemory

__all__ = ["Applied", "MemOpt", "PeakMemory"]
