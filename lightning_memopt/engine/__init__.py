"""The engine: one config type, step dry runs, the techniques applied and undone as one transaction, the choice of
settings, and the measured batch. Lightning's loop is not here: :mod:`lightning_memopt.callbacks` drives the engine
from a Trainer's hooks, and :func:`lightning_memopt.estimate` without one. The engine imports neither."""

from lightning_memopt.engine.config import MemOptConfig

__all__ = ["MemOptConfig"]
