"""lightning_memopt: make big models fit in memory with one Lightning callback.

Example:
    >>> from lightning_memopt import MemOpt
    >>> MemOpt().chunk_config.chunk_size
    2
"""

from lightning_memopt.callbacks import Applied, MemOpt, PeakMemory
from lightning_memopt.memory import CPUPeakTracker

__all__ = ["Applied", "CPUPeakTracker", "MemOpt", "PeakMemory", "__version__"]
__version__ = "0.1.0"
