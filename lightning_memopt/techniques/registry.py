"""The registry of technique plug-ins: the built-in ones, and any registered with :func:`register_technique`, in the
order they are applied to each model, planned and reported."""

from __future__ import annotations

from lightning_memopt.techniques.base import Technique

#: Every stage a technique can act in.
STAGES = ("fit", "predict", "validate", "test")

#: The technique classes, in order. Read it through :func:`techniques_for`; change it through
#: :func:`register_technique` and :func:`unregister_technique`.
REGISTRY: list[type[Technique]] = []


def register_technique(technique: type[Technique], before: type[Technique] | None = None) -> type[Technique]:
    """Register a technique class, so that MemOpt and :func:`~lightning_memopt.estimate` apply, plan, report, log,
    save and undo it in its stages, with the built-in ones. Usable as a class decorator.

    Args:
        technique: A subclass of :class:`~lightning_memopt.techniques.base.Technique` with a ``name`` of its own and
            its ``stages``.
        before: Apply it before this registered technique (by default after every one).

    Returns:
        ``technique``, registered.

    Raises:
        ValueError: If it is not a ``Technique``, its name is taken or empty, its stages are not among ``fit``,
            ``predict``, ``validate`` and ``test``, or ``before`` is not registered.

    Examples:
        >>> from lightning_memopt.techniques.base import Technique
        >>> class Mark(Technique):
        ...     name, stages = "mark", ("predict",)
        >>> _ = register_technique(Mark)
        >>> [t.name for t in techniques_for("predict")][-1]
        'mark'
        >>> register_technique(Mark)
        Traceback (most recent call last):
        ...
        ValueError: a technique named 'mark' is registered already (Mark)
        >>> unregister_technique(Mark); Mark in REGISTRY
        False
    """
    if not (isinstance(technique, type) and issubclass(technique, Technique)):
        raise ValueError(f"`technique` must be a subclass of Technique, got {technique!r}")
    name = technique.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"a technique needs a non-empty `name`, got {name!r} on {technique.__name__}")
    taken = next((t for t in REGISTRY if t.name == name), None)
    if taken is not None:
        raise ValueError(f"a technique named {name!r} is registered already ({taken.__name__})")
    stages = technique.stages
    if not stages or isinstance(stages, str) or any(s not in STAGES for s in stages):
        raise ValueError(f"the `stages` of {technique.__name__} must be some of {STAGES}, got {stages!r}")
    if before is not None and before not in REGISTRY:
        raise ValueError(f"`before` must be a registered technique, got {before!r}")
    REGISTRY.insert(REGISTRY.index(before) if before is not None else len(REGISTRY), technique)
    return technique


def unregister_technique(technique: type[Technique]) -> None:
    """Take a registered technique out of the registry (nothing happens where it is not registered)."""
    if technique in REGISTRY:
        REGISTRY.remove(technique)


def techniques_for(stage: str) -> list[type[Technique]]:
    """The registered techniques that act in ``stage``, in order."""
    return [t for t in REGISTRY if stage in t.stages]
