"""A causal language model's loss computed in chunks at fit: the mechanics (:mod:`.core`) and the plug-in
(:mod:`.technique`)."""

from lightning_memopt.techniques.loss.core import LossUnit, chunked_cross_entropy
from lightning_memopt.techniques.loss.technique import ChunkedLoss

__all__ = ["ChunkedLoss", "LossUnit", "chunked_cross_entropy"]
