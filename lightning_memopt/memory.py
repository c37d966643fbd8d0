"""Peak-memory probes. On CPU, exact accounting of the bytes of live tensor storages."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary


class CPUPeakTracker(TorchDispatchMode):
    """Count, byte for byte, the storages that tensors allocate while the tracker is active, and their peak.

    Every tensor an operator returns is looked at; a storage is counted once, from the op that first returns it until
    it is freed. Storages that already existed can be added with :meth:`add` (for example the parameters, gradients
    and optimizer state), so that :attr:`peak` means what ``torch.cuda.max_memory_allocated`` means on a GPU:
    everything live. The figure is deterministic: the same code gives the same bytes on every run.

    Example:
        >>> import torch
        >>> with CPUPeakTracker() as tracker:
        ...     a = torch.empty(1000)   # 4000 bytes
        ...     b = torch.empty(500)    # 2000 bytes
        ...     del a
        ...     c = torch.empty(200)    # 800 bytes
        >>> tracker.peak, tracker.current
        (6000, 2800)
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages that are already alive, such as ``model.parameters()``."""
        for tensor in tensors:
            self._track(tensor)

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, nbytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out
