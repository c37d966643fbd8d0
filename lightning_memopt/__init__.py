"""lightning_memopt: make big models fit in memory with one Lightning callback.

Examples:
    >>> from lightning_memopt import MemOpt
    >>> MemOpt(memory_budget="1GiB").config.memory_budget
    1073741824
"""

from lightning_memopt.callbacks import Applied, MemOpt, MemOptReport, PeakMemory
from lightning_memopt.estimate import Estimate, estimate
from lightning_memopt.memory import CPUPeakTracker, is_oom
from lightning_memopt.techniques import Technique, register_technique, unregister_technique
from lightning_memopt.verify import VerificationError

__all__ = [
    "Applied",
    "CPUPeakTracker",
    "Estimate",
    "MemOpt",
    "MemOptReport",
    "PeakMemory",
    "Technique",
    "VerificationError",
    "__version__",
    "estimate",
    "is_oom",
    "register_technique",
    "unregister_technique",
]
__version__ = "0.1.0"
