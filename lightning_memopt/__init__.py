"""lightning_memopt: make big models fit in memory with one Lightning callback.

The names below are imported when first used (``from lightning_memopt import MemOpt``), so that the
``lightning-memopt`` command answers ``--help`` without importing torch and Lightning.

Examples:
    >>> from lightning_memopt import MemOpt
    >>> MemOpt(memory_budget="1GiB").config.memory_budget
    1073741824
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_memopt.callbacks import Applied, MemOpt, MemOptReport, PeakMemory
    from lightning_memopt.estimate import Estimate, estimate
    from lightning_memopt.memory import CPUPeakTracker, is_oom
    from lightning_memopt.techniques import Technique, register_technique, unregister_technique
    from lightning_memopt.verify import VerificationError

#: Where each public name lives.
_HOMES = {
    "Applied": "lightning_memopt.callbacks",
    "MemOpt": "lightning_memopt.callbacks",
    "MemOptReport": "lightning_memopt.callbacks",
    "PeakMemory": "lightning_memopt.callbacks",
    "Estimate": "lightning_memopt.estimate",
    "estimate": "lightning_memopt.estimate",
    "CPUPeakTracker": "lightning_memopt.memory",
    "is_oom": "lightning_memopt.memory",
    "Technique": "lightning_memopt.techniques",
    "register_technique": "lightning_memopt.techniques",
    "unregister_technique": "lightning_memopt.techniques",
    "VerificationError": "lightning_memopt.verify",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lightning_memopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


class _Package(types.ModuleType):
    """The package, whose function ``estimate`` shares its name with a submodule: importing the submodule would set
    the package's ``estimate`` to the module (as Python does for a submodule once it is loaded), hiding the
    function from a later ``from lightning_memopt import estimate``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not (isinstance(value, types.ModuleType) and name in _HOMES):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
