"""The stage's planner: it chooses the settings of every technique's knobs (:class:`~lightning_memopt.techniques.
base.Knob`) under one budget, from one cost table, for the least work, without knowing which technique a knob is.

**Rows.** Knobs on one module form one row; its settings are every combination of theirs (a technique whose knob
changes what another technique's module keeps, such as a feed-forward's chunking inside a checkpointed block, puts its
knob on that module). A row on a module inside another row's module (a checkpointed attention inside a checkpointed
block) is a row of its own: what it keeps is counted apart from the outer one's. Rows are taken in the order their
modules run forward.

**The cost table.** Dry runs of a later step (last step's gradients and the optimizer state alive) give, for each row
and setting: the bytes its forward pass leaves alive for the backward pass (less those freed as it returns, before
anything else runs: its inputs, where it keeps copies on the host), the peak while its backward pass runs
(from the moment the gradient of its output is computed until the next row's backward pass starts) or while its
forward runs, the FLOPs it recomputes (all read from the run's :class:`~lightning_memopt.timeline.Timeline`), and
its cost: its predicted time (every op of its forward pass and of its backward window) plus what its knobs add
(:attr:`~lightning_memopt.techniques.base.Knob.cost`). The first run has every row at its first setting. At fit,
a row whose settings all keep results (``Row.alone_at_fit``) is filled in that run: when its module is first
called, it runs again alone, forward and backward, at each setting, on that call's inputs cut from the step's graph
(counted apart from the step; modules of one class, parameters and inputs, with their shapes, types and
``requires_grad``, share one run per setting, so N identical blocks cost what one does), and the row's figures at a
setting are the first run's moved by what the setting changed alone, in each call. A setting whose effect running
alone does not show (:attr:`~lightning_memopt.techniques.base.Knob.alone`: a checkpoint that sends its input to the
host) is left out of those, and so is one a knob finds not worth a run (:attr:`~lightning_memopt.techniques.base.Knob.
worth`) from the figures of the settings run alone before it. Where the mixes so modelled meet no target, the
settings running alone does not show are measured as the other rows are: one run per setting any row has, every row
that has it (and finds it worth a run) at it, the others at their reference; and where a check then finds the table
more than :data:`MISS` off its dry run (the rows' references, a mix checked, or the mix it models lowest, run then),
every setting of those rows is (what the bytes alive around a module do to its figures shows only in the whole step).
The peak before any row's backward pass is noted too. A row of a module that runs without gradients (a
loop's block, a VAE decode) may instead be filled by replays (:attr:`~lightning_memopt.techniques.base.Knob.replay`):
in the first run the module runs alone again at each setting, and the row's figures at a setting are the first run's
moved by what the replay changed; under a budget, a run without replays comes first, and where the step meets the
budget as it is, it is the whole table.

**The peak of a mix** is modelled from the table. While row ``j``'s backward pass runs, the rows before it still hold
what their forward passes kept: the peak there is row ``j``'s window, as measured in the run that gave ``j``'s
setting, less what the rows before it kept in that run, plus what they keep in the mix. Before the backward pass,
every row holds what it kept. A row without a backward window holds its forward peak at its setting, with every other
row's bytes kept alive. This model makes position matter (a row's saving lowers only the windows after it) and is
exact for the runs it was measured on.

**The choice** is the mix with the least cost whose modelled peak meets the target (the budget or, without one,
:data:`SLACK` above the peak with every knob at its reference), found by dynamic programming over the rows in order
(each partial mix kept only if no other has both fewer bytes kept and less cost). A dry run with the mix checks it. A
mix over the target is chosen again for a target lowered by the miss; one well under it, for a target raised by the
room left, since a cheaper mix may fit (:data:`CHECKS` dry runs at most). Of every mix dry-run (the table's runs
and the checks), the one with the least predicted step time that met the target is kept: the table shares a step's
time out per row only roughly. The ops a mix routes through a selective policy's Python dispatch mode are priced
once more (:data:`DOUBT`) in that ranking: their cost moves most with the host. Where no mix meets the target,
the run with the lowest peak is kept.

**Knobs of the whole step** (no module: the optimizer step in the backward pass, the optimizer state or the weights in
8 bits) are not rows. Each of their settings is measured alone, every row at its first setting: what it saves on the
step's peak and adds to its predicted time (a dry run each, or the knob's ``estimate``). A mix of them moves every
modelled peak down by the sum of their savings, and adds their seconds; the rows' cheapest mix is found for each mix of
them, and the cheapest of all is checked by a dry run with everything in force. Settings that change results
(``Knob.lossy``) are chosen only where the stage allows them (``lossy=True``): a step knob's compete on predicted time
with the mixes that keep results; a replayed row's are replayed and tried only where no mix that keeps results meets
the budget.

The cost is time: each row's predicted time (:mod:`~lightning_memopt.timing`) in the run that measured its setting,
and a checked mix's the whole step's predicted time, plus what the knobs' ``cost`` adds (seconds).
"""

from lightning_memopt.techniques.planner.measured import BlockRecorder
from lightning_memopt.techniques.planner.model import LEVELS, RESOLUTION, Figures, Option, Run, Table, solve, solve_many
from lightning_memopt.techniques.planner.search import (
    CHECKS,
    DOUBT,
    MISS,
    SLACK,
    Outcome,
    Row,
    choose,
    fastest,
    rows_of,
)

__all__ = [
    "CHECKS",
    "DOUBT",
    "LEVELS",
    "MISS",
    "RESOLUTION",
    "SLACK",
    "BlockRecorder",
    "Figures",
    "Option",
    "Outcome",
    "Row",
    "Run",
    "Table",
    "choose",
    "fastest",
    "rows_of",
    "solve",
    "solve_many",
]
