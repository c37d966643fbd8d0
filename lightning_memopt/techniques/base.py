"""The contract of a technique plug-in: what the engine's stage pipeline (:mod:`lightning_memopt.engine.stage`) calls,
and what a technique hands back: its :class:`Change` to each model, its :class:`Plan`, its :class:`Section` of the
report.

A technique is one object per run of a stage (the stage makes one of each registered class whose ``stages`` hold it
and whose ``option`` is on, see :mod:`lightning_memopt.techniques.registry`). It finds its units in each model
(through the adapters' discovery), applies and undoes itself as a transaction, is the only writer of its settings in
force, switches its units off for a while to show the model as the user gave it, chooses its settings from dry runs
(:meth:`Technique.plan`), makes ranks agree, steps finer when a batch runs out of memory, writes its own section of
the report, and keeps what a resumed run needs. The engine never names a technique: it calls these methods on every
technique of the stage, in the registry's order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class Applied:
    """What MemOpt did to one model in a run.

    Attributes:
        model: The model's attribute path and class, such as ``unet (UNet2DModel)``.
        technique: The technique's ``name``: ``checkpointing``, ``chunking``, ``decoding`` (VAE slicing and tiling),
            or that of a technique registered by the user.
        method: The library switch that was used, or ``generic ...``.
        blocks: How many blocks it reached.
        unit: What one of them is called: ``block``, ``autoencoder``.
    """

    model: str
    technique: str
    method: str
    blocks: int
    unit: str = "block"


@dataclass
class Change:
    """One technique applied to one model (what :meth:`Technique.apply` returns).

    Attributes:
        method: How it was applied, for the user: the library switch that was called, or ``generic``.
        blocks: How many blocks (layers) it reached.
        handle: Undoes the change exactly (``remove()``, safe to call twice).
        units: The technique's units in this model, whose settings can be changed while the model runs (a chunked
            block, an autoencoder's decode).
        switches: For checkpointing, the blocks that can be switched off and on one by one (a model whose library
            has one flag for all its blocks has none).
        skipped: Parts of the model left unchanged, each with the reason, for a warning.
        unit: What one of the blocks is called in the summary: ``block``, ``autoencoder``.
    """

    method: str
    blocks: int
    handle: Any
    units: list[Any] = field(default_factory=list)
    switches: list[Any] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unit: str = "block"


@dataclass
class Switchable:
    """A changed module: its name, the method its calls go through, and how to switch the change on and off."""

    name: str
    module: nn.Module
    method: str
    on: Callable[[], None]
    off: Callable[[], None]


def _free(setting: Hashable) -> float:
    return 0.0


def _worth(setting: Hashable, seen: Callable[[Hashable], Any]) -> bool:
    return True


def _exact(setting: Hashable) -> bool:
    return False


def _shown(setting: Hashable) -> bool:
    return True


def _goes(setting: Hashable, others: dict[str, Hashable]) -> bool:
    return True


@dataclass
class Knob:
    """A setting of one module that the stage's planner chooses, together with every other technique's, under one
    budget from one cost table (:mod:`~lightning_memopt.techniques.planner`). A technique offers its knobs in
    :meth:`Technique.knobs`.

    Knobs on one module form one row of the table, whose settings are every combination of theirs: each setting of a
    row costs the planner a dry run of the step. A knob whose setting changes what another technique's module keeps
    (a feed-forward's chunking inside a checkpointed block) belongs on that module, to be priced in combination.

    Attributes:
        name: The module's name, for notes.
        module: The module it acts on: the planner records what it keeps for the backward pass, its peak while its
            backward pass runs, and the FLOPs it recomputes (those run under
            :func:`~lightning_memopt.flops.recomputing`).
        settings: The settings it may take, the one that changes nothing first; where two are found to keep the
            same bytes for the same cost, the one listed first is chosen. A setting is tried only after those before
            it, so :attr:`worth` can read their figures.
        set: Puts a setting in force.
        get: The setting in force.
        reference: The setting whose peak, without a budget, the planner stays near (:data:`~lightning_memopt.
            techniques.table.SLACK`): for checkpointing, the model's own switch.
        cost: The time a setting adds to a step that its dry runs do not show (time waited, bytes moved over a link),
            in seconds (none by default); the planner adds it to the step's predicted time.
        worth: Whether a setting is worth a dry run, given ``seen(setting)``: the figures this knob's module gave with
            an earlier setting (``kept``, ``recomputed``, ``attention`` FLOPs recomputed), or ``None``.
        replay: For a module that runs without gradients (a loop's block, a VAE decode): its row is filled by running
            it alone again at each setting, on its first call's inputs, in the table's first dry run, instead of a dry
            run of the whole step per setting. Given that call's ``(args, kwargs)``, it returns the settings to try
            (every one the knob may take for such inputs, ``settings[0]`` first) and the reference among them; until
            then the knob has ``settings[0]`` alone. They are replayed in that order, from the cheapest, each expected
            to hold less than the one before: the first that holds no less than one before it ends the replay (it and
            those after it would only cost more), as does, without a budget, the reference. Such a knob is alone on its
            module.
        method: The module's method whose calls the planner watches (``forward``; ``decode`` for an autoencoder).
        lossy: Whether a setting changes results (VAE tiling): the planner tries those only under a budget, and
            chooses them only where the stage allows it (``Planning.lossy``) and no mix that keeps results is
            predicted faster.
        estimate: For a knob of the whole step whose setting is costly to put in force (weights stored in 8 bits):
            the bytes a setting saves on the step's peak and the seconds it adds, without a dry run (the planner's
            check of its choice dry-runs it). Without it, a dry run per setting measures both.
        goes_with: For a knob of the whole step: whether a setting goes with the other step knobs' settings (by
            knob name) in one mix; a mix where one does not is never dry-run nor chosen (an optimizer state in 8 bits
            and one kept in full on the host).
        alone: Whether the module run alone shows what a setting does (at fit the planner runs each kind of module
            alone at each setting); a setting whose effect shows only in the whole step (a checkpoint that sends its
            input to the host frees it only there) is measured by a dry run of the whole step.

    A knob without a ``module`` is a setting of the whole step (the optimizer step in the backward pass, the
    optimizer state in 8 bits): the planner measures what each of its settings saves on the step's peak and adds to
    its time, and ranks it with the modules' rows. Its ``set`` only says what the dry runs see; the technique puts
    the setting in force for real when the next batch starts (:meth:`Technique.batch_start`).
    """

    name: str
    module: nn.Module | None
    settings: tuple[Hashable, ...]
    set: Callable[[Hashable], None]
    get: Callable[[], Hashable]
    reference: Hashable
    cost: Callable[[Hashable], float] = _free
    worth: Callable[[Hashable, Callable[[Hashable], Any]], bool] = _worth
    replay: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Hashable, ...], Hashable]] | None = None
    method: str = "forward"
    lossy: Callable[[Hashable], bool] = _exact
    estimate: Callable[[Hashable], tuple[int, float]] | None = None
    goes_with: Callable[[Hashable, dict[str, Hashable]], bool] = _goes
    alone: Callable[[Hashable], bool] = _shown

    @property
    def of_the_step(self) -> bool:
        """Whether it is a setting of the whole step (no ``module``)."""
        return self.module is None


@dataclass
class Planning:
    """What a technique's planner gets from the stage: the batch to plan for, as dry runs of the step on it.

    Attributes:
        stage: ``fit``, ``predict``, ``validate`` or ``test``.
        budget: The peak to stay under, in bytes (``None``: the technique's own target).
        choose: Choose settings (``False``: the settings in force were reused for these shapes, say from a resumed
            run; a planner may still count what they cost).
        measure: A batch of the stage will be measured.
        lossy: Settings that change results (VAE tiling) may be chosen (not under ``verify``).
        run: ``run(watch, steady=False)`` dry-runs the step on the batch (see
            :func:`~lightning_memopt.engine.step.dry_run_step`), replaying a real step's reads where there are any;
            ``watch`` is entered around it with the running probe.
        off: ``off()`` is a context in which every change of the stage is switched off (the model as given).
        module: The LightningModule (or the module) whose step runs.
        longer: The batch holds longer inputs than those settings were chosen for.
        chosen: What the stage's planner chose for the knobs of every technique (a
            :class:`~lightning_memopt.techniques.planner.Outcome`, its settings in force), or ``None`` where no
            technique offered a knob.
        device: The device the step runs on (the time model's speeds are measured on it).
        target: The device planned for: ``device``, or the accelerator an estimate's dry runs stand in for on this
            machine's CPU (``estimate(device="cuda")`` without a GPU).
        changed: ``changed()`` says whether any change of the stage is in force now.
        techniques: The stage's techniques (:meth:`technique` finds one by class), for one whose figures depend on
            what others have in force.
    """

    stage: str
    budget: int | None
    choose: bool
    measure: bool
    lossy: bool
    run: Callable[..., Any]
    off: Callable[[], contextlib.AbstractContextManager[None]]
    module: Any = None
    longer: bool = False
    chosen: Any = None
    device: Any = "cpu"
    target: Any = "cpu"
    changed: Callable[[], bool] = lambda: False
    techniques: tuple[Any, ...] = ()

    def technique(self, cls: type) -> Any | None:
        """The stage's technique of class ``cls``, or ``None``."""
        return next((t for t in self.techniques if isinstance(t, cls)), None)


@dataclass
class Plan:
    """What a technique's planner did (its settings are in force afterwards).

    Attributes:
        seconds: The time its dry runs took.
        notes: What limited the choice, for the report.
        loud: The notes also said as warnings, when they are new to the report.
        peak_bytes: The peak the dry run with the choice gave (``None``: unknown, or it could not be traced).
        placeholders: The dry runs stood in for values the step read: the real step's peak checks the choice.
        baseline: A dry run of the batch without any change, where the planner made one (the measured batch reuses
            it as its baseline).
        part: The part of the model that holds the peak with the choice (``feed-forward``, ``VAE decode``, ...).
        part_without: The same without the changes.
        said: Lines for the user (a callable gives its line once the ranks agreed).
        warnings: Lines for the user, as warnings.
        predicted_s: The step's time with the choice, as the time model predicts it (see
            :mod:`~lightning_memopt.timing`), and ``calibration_s`` the time measuring the device's speeds took.
        ranked: Whether the predicted time chose among several mixes that met the target (else it decided nothing).
    """

    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    loud: list[str] = field(default_factory=list)
    peak_bytes: int | None = None
    placeholders: bool = False
    baseline: Any = None
    part: str | None = None
    part_without: str | None = None
    said: list[Any] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    predicted_s: float | None = None
    calibration_s: float | None = None
    ranked: bool = False


@dataclass
class Section:
    """A technique's own part of the report.

    Attributes:
        settings: What it has in force, in words, by key (``checkpointed``, ``chunk_settings``): sent to the loggers
            as hyperparameters (``memopt/<stage>/<key>``) and read as attributes of the report
            (``report.checkpointed``); the summary shows :attr:`lines`.
        metrics: Its figures by key (``recompute_flops``): logged as ``memopt/<key>`` where known, and read as
            attributes of the report.
        figures: Its figures that are not logged (``forward_flops``), read as attributes of the report.
        lines: The summary's lines for it.
        notes: What limited its figures, for the report's notes.
    """

    settings: dict[str, str | None] = field(default_factory=dict)
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Technique:
    """A technique plug-in. Subclasses set the class attributes and implement :meth:`apply`, :meth:`remove`,
    :meth:`off` and :attr:`changed`; every other method has a default that does nothing. Register one with
    :func:`~lightning_memopt.register_technique`.

    Examples:
        >>> class Mark(Technique):
        ...     name, stages, option = "mark", ("predict",), "chunking"
        >>> Mark.enabled_by(type("Config", (), {"enabled": True, "chunking": False})())
        False
    """

    #: Its name in reports, logs and saved state.
    name: ClassVar[str] = ""
    #: The stages it acts in: ``"fit"``, and the loops without gradients ``"predict"``, ``"validate"``, ``"test"``.
    stages: ClassVar[tuple[str, ...]] = ()
    #: The MemOpt option that turns it on (``"checkpointing"``, ``"chunking"``); ``None``: on whenever MemOpt is.
    option: ClassVar[str | None] = None
    #: Its planner chooses again for a batch with longer inputs than it chose for (not only at the first batch).
    replans_longer: ClassVar[bool] = False
    #: What it adds to the step's time is timed alone when the stage ends (:meth:`switchables`), not in the step.
    timed_alone: ClassVar[bool] = False
    #: Its place when a batch runs out of memory: techniques step :meth:`finer` in this order, lowest first.
    rescue_order: ClassVar[int] = 0
    #: The keys of its :meth:`section` (settings, metrics and figures), read as attributes of the report (``None``
    #: where a report has no section of it).
    reports: ClassVar[tuple[str, ...]] = ()
    #: It changes the training step (the optimizer's part) rather than the model's blocks: a model that it alone reaches
    #: still has nothing MemOpt can use (the warning about it, and ``strict``).
    of_the_step: ClassVar[bool] = False
    #: It acts only where a model happens to hold what it needs (PEFT's LoRA layers), on whenever MemOpt is: a model
    #: without it is not said to be skipped for it, and what it reaches alone is not said to make a model usable.
    incidental: ClassVar[bool] = False
    #: The Trainer's facts (a :class:`~lightning_memopt.engine.step.StepContext`: optimizers, gradient accumulation,
    #: clipping, precision, strategy), set on each instance before :meth:`apply`; ``None`` outside a stage.
    context: Any = None

    @classmethod
    def enabled_by(cls, config: Any) -> bool:
        """Whether MemOpt's options (a :class:`~lightning_memopt.engine.config.MemOptConfig`) turn it on."""
        return bool(config.enabled) and (cls.option is None or bool(getattr(config, cls.option)))

    @classmethod
    def may_act(cls, config: Any) -> bool:
        """Whether these options may put it in force at all (an ``"auto"`` one without the budget or the
        ``lossy=True`` it needs cannot be): only then is its standing down worth a warning."""
        return True

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        """Whether ``memory_budget`` steers it with these options (its planner's target, or a finer step when a
        batch goes over it)."""
        return False

    @classmethod
    def budget_unused(cls, config: Any) -> str | None:
        """Why ``memory_budget`` chooses nothing of this technique with these options, for a warning (``None``: it
        does, or it has nothing to choose)."""
        return None

    @classmethod
    def refuses(cls, context: Any) -> str | None:
        """Why it stays off with this Trainer (``context``: a :class:`~lightning_memopt.engine.step.StepContext`,
        whose ``strategy``, optimizers, gradient accumulation, clipping and precision it may read), for a warning: a
        strategy that does the same itself, or a setting under which it cannot keep results exact."""
        return None

    @classmethod
    def validate(cls, config: Any, found: list[Any]) -> None:
        """Raise ``ValueError`` where its options do not fit the models found (a block class that none has)."""

    def apply(self, found: Any, config: Any) -> Change | None:
        """Change one model (``found``: a :class:`~lightning_memopt.adapters.FoundModel`; ``config``: MemOpt's
        options); ``None`` where it has nothing this technique can use. Raises, having undone its part of that model,
        where it cannot be changed."""
        raise NotImplementedError

    def remove(self) -> None:
        """Forget its units, once the stage has removed the handle of every :class:`Change` it returned (in the
        reverse of the order they were made); safe to call twice."""
        raise NotImplementedError

    def off(self) -> contextlib.AbstractContextManager[None]:
        """Every unit switched off for a while (the model as the user gave it), then back as it was."""
        raise NotImplementedError

    @property
    def changed(self) -> bool:
        """Whether any unit is in force."""
        raise NotImplementedError

    def describe(self) -> str | None:
        """The settings in force, in words (``None``: nothing to say)."""
        return None

    def summary(self) -> str | None:
        """What it has in force in a few words, with its name, for one line about the whole stage (``None``:
        nothing)."""
        described = self.describe()
        return f"{self.name}: {described}" if described is not None else None

    def state(self) -> dict[str, Any]:
        """The settings in force as plain values, for a checkpoint (``state_dict``)."""
        return {}

    def load(self, state: dict[str, Any]) -> bool:
        """Put saved settings in force; ``False`` where they do not fit the units (then nothing is changed)."""
        return True

    def optimizer_step(self, default: Callable[[list[Any]], None]) -> Callable[[list[Any]], None] | None:
        """How a dry run steps the optimizers (twins over fake parameters) with this technique in force, for one that
        changes the optimizer step; ``default`` is how it would step them without it. ``None``: as ``default``."""
        return None

    def around_backward(self, default: Callable[..., Any]) -> Callable[..., Any] | None:
        """What a dry run enters around the backward pass with this technique in force (a function of the optimizers,
        twins over fake parameters, and ``stepping(optimizers, step)``, which runs ``step`` counted as an optimizer
        step, that returns a context manager), for one that steps the optimizers inside it; ``default`` is what it
        would enter without it. ``None``: as ``default``."""
        return None

    def around_twins(self, default: Callable[..., Any]) -> Callable[..., Any] | None:
        """What a dry run enters once it has made the optimizers' twins over fake parameters (a function of
        ``(twin, optimizer)`` pairs that returns a context manager, entered before any twin is stepped and left when
        the run's count is done), for one that keeps the optimizers' state in a form of its own: the twins' state is
        a fake copy of the optimizers'; ``default`` is what it would enter without it. ``None``: as ``default``."""
        return None

    def gradients_kept(self, default: Callable[[], bool]) -> Callable[[], bool] | None:
        """Whether, with this technique in force, the last step's gradients are alive when a dry run's step starts
        (a function of nothing, called as the run starts), for one that frees them earlier than Lightning does;
        ``default`` says it without it. ``None``: as ``default``."""
        return None

    def gradients_freed(self) -> list[Any]:
        """The parameters whose gradients it freed before Lightning would have (the step without it holds them, and
        the baseline counts them)."""
        return []

    def knobs(self, planning: Planning) -> list[Knob]:
        """Its settings for the stage's planner, which chooses them with every other technique's under one budget,
        before :meth:`plan` runs (none: it plans alone in :meth:`plan`, or has nothing to choose)."""
        return []

    def plan(self, planning: Planning) -> Plan | None:
        """Choose its settings from dry runs of the batch, or say what the stage's planner chose for its knobs
        (``planning.chosen``); ``None``: nothing to choose or say."""
        return None

    def agree(self, reduce_max: Callable[[list[float]], list[float]]) -> None:
        """After :meth:`plan` on every rank: make the ranks' settings agree (``reduce_max`` gives the maximum of each
        number over ranks; every rank calls it with as many numbers)."""

    def finer(self, lossy: bool) -> str | None:
        """One step cheaper in memory, after a batch ran out of memory or over the budget: says what it did, or
        ``None`` where it has nothing left (only steps that change results where ``lossy``)."""
        return None

    def batch_start(self) -> None:
        """A batch of the stage is about to run, with the settings in force."""

    def batch_end(self) -> None:
        """The batch ran."""

    def end(self) -> None:
        """The stage ends, outside every batch (what is measured here goes into :meth:`section`)."""

    def abort(self) -> None:
        """The stage stops, normally or by an exception: nothing of its measuring stays hooked in."""

    def notices(self, budget: int | None) -> list[str]:
        """Warnings about what it has in force now, each given once (``budget``: the stage's, if any)."""
        return []

    def section(self) -> Section:
        """Its part of the report."""
        return Section()

    def switchables(self) -> list[Switchable]:
        """The changed modules in force, each with how to switch it on and off, to time what the change costs when
        the stage ends; none where it is timed in the step."""
        return []

    def timer(self, synchronize: Callable[[], None]) -> Any:
        """What times, in the step itself, the work the technique adds (``None``: it is timed alone afterwards, or
        adds none); ``.seconds`` and ``.remove()``."""
        return None


def planned_peak(planning: Planning) -> int | None:
    """The step's peak with the settings in force: the stage planner's check of its choice, or where there is none a
    dry run's (``None``: no figure)."""
    chosen = planning.chosen.peak_bytes if planning.chosen is not None else None
    return chosen if chosen is not None else planning.run(steady=True).peak_bytes


def saving(technique: Technique, planning: Planning) -> int | None:
    """What ``technique`` in force saves on the step's peak: where the stage's planner put its knob of the whole step
    in force, as the planner models it (``Outcome.step_saved``: no dry run more); else from a dry run without it (the
    others as they are) and the stage planner's check of its choice, or a dry run with it where there is none; ``None``
    where it is not in force, saves nothing or a run gives no figure."""
    if not technique.changed:
        return None
    modelled = planning.chosen.step_saved.get(technique.name) if planning.chosen is not None else None
    if modelled is not None:
        return modelled if modelled > 0 else None
    on = planned_peak(planning)
    with technique.off():
        off = planning.run(steady=True).peak_bytes
    return off - on if on is not None and off is not None else None


class OnOff:
    """``off()`` for a technique whose units follow one flag, ``_on``: its ``changed`` reads it."""

    _on: bool = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        was, self._on = self._on, False
        try:
            yield
        finally:
            self._on = was


class OfTheStep(Technique):
    """What the techniques share whose setting is one of the whole step and held back until the stage's budget needs
    it (the optimizer step in the backward pass, the optimizer state and the weights in 8 bits): with their option
    ``"auto"`` and a budget, one knob without a module (:class:`Knob`) for the stage's planner, which puts it in
    force where that is the fastest way under the budget; with ``True``, in force from the start. A subclass gives
    its :meth:`settings` (off first), :meth:`put` and :meth:`setting` (what the dry runs see; the real change waits for
    :meth:`batch_start`), :attr:`lossy` where its settings but the first change results, and may :meth:`estimate`
    a setting without a dry run. Lines for the user go to ``_said``, each given once."""

    #: Its settings but the first change results.
    lossy: ClassVar[bool] = False
    _auto: bool = True
    _said: list[str]

    @property
    def ready(self) -> bool:
        """Whether it has anything to put in force."""
        raise NotImplementedError

    def settings(self) -> tuple[Hashable, ...]:
        return (False, True)

    def setting(self) -> Hashable:
        raise NotImplementedError

    def put(self, setting: Hashable) -> None:
        raise NotImplementedError

    def estimate(self, setting: Hashable) -> tuple[int, float]:
        """The bytes ``setting`` saves on the step's peak and the seconds it adds, without a dry run."""
        raise NotImplementedError

    def cost(self, setting: Hashable) -> float:
        """The seconds ``setting`` adds to a step that its dry runs do not show (bytes moved over a link)."""
        return 0.0

    def goes_with(self, setting: Hashable, others: dict[str, Hashable]) -> bool:
        """Whether ``setting`` goes with the other step knobs' settings, by name, in one step (see :class:`Knob`)."""
        return True

    def knobs(self, planning: Planning) -> list[Knob]:
        """Its knob, with ``"auto"`` under a budget (one whose settings change results only where the stage allows
        it: else :meth:`would_reach` says what it would have done)."""
        lossy_here = type(self).lossy and not planning.lossy
        if lossy_here or not (self._auto and self.ready and planning.budget is not None and planning.choose):
            return []
        settings, lossy = self.settings(), type(self).lossy
        estimate = self.estimate if overrides(self, "estimate", OfTheStep) else None
        return [
            Knob(
                self.name,
                None,
                settings,
                self.put,
                self.setting,
                settings[0],
                cost=self.cost,
                lossy=lambda setting: lossy and setting != settings[0],
                estimate=estimate,
                goes_with=self.goes_with,
            )
        ]

    def would_reach(self, planning: Planning) -> tuple[int, int] | None:
        """For one whose settings change results, where the stage does not allow that and the budget is missed: the
        peak planned and what its last setting would reach (from :meth:`estimate`, else a dry run with it, put back
        after); ``None`` where the budget is met or it would not help."""
        if not (type(self).lossy and self._auto and self.ready and planning.budget is not None and planning.choose):
            return None
        missed = planned_peak(planning)
        if missed is None or missed <= planning.budget or planning.lossy:
            return None
        last = self.settings()[-1]
        if overrides(self, "estimate", OfTheStep):
            would: int | None = missed - self.estimate(last)[0]
        else:
            was = self.setting()
            self.put(last)
            try:
                would = planning.run(steady=True).peak_bytes
            finally:
                self.put(was)
        return (missed, would) if would is not None and would < missed else None

    def notices(self, budget: int | None) -> list[str]:
        said, self._said = self._said, []
        return said


class FreesGradients(OnOff):
    """What the techniques that free gradients early share (free_gradients, optimizer_in_backward): the baseline
    counts the gradients they freed, a dry run's step starts without the last one's, and ``off()`` switches them off
    for a while. ``changed`` is theirs."""

    _freed: dict[int, torch.Tensor]
    changed: bool

    def gradients_freed(self) -> list[Any]:
        return list(self._freed.values())

    def gradients_kept(self, default: Callable[[], bool]) -> Callable[[], bool]:
        return lambda: default() and not self.changed

    def frees_in_backward(self, ids: set[int]) -> bool:
        """Whether, in force, it frees the gradient of every parameter whose id is in ``ids`` in the backward pass."""
        return False


def trainable(found: Any) -> dict[int, torch.Tensor]:
    """The trainable parameters of a found model, by id."""
    return {id(p): p for p in found.module.parameters() if p.requires_grad}


def overrides(technique: Any, method: str, base: type | None = None) -> bool:
    """Whether ``technique``'s class defines ``method`` for itself (the default of ``base``, :class:`Technique`
    where ``None``, does nothing)."""
    return getattr(type(technique), method) is not getattr(base or Technique, method)


def twin_ids(twin: Any, optimizer: Any, ids: set[int]) -> set[int]:
    """The ids of ``twin``'s parameters (a dry run's copy of ``optimizer``, group for group and parameter for
    parameter) that stand for the parameters of ``optimizer`` whose ids are in ``ids``."""
    return {
        id(fake)
        for twin_group, group in zip(twin.param_groups, optimizer.param_groups, strict=True)
        for fake, param in zip(twin_group["params"], group["params"], strict=True)
        if id(param) in ids
    }
