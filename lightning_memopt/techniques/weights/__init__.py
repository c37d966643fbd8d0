"""Weights kept in 8 bits, computed in their own type one layer at a time, where results may change
(``lossy=True``): the mechanics (:mod:`.core`) and the plug-in (:mod:`.technique`)."""

from lightning_memopt.techniques.weights.core import Host, StoredWeight, storable
from lightning_memopt.techniques.weights.technique import Weights8bit

__all__ = ["Host", "StoredWeight", "Weights8bit", "storable"]
