"""Nothing lost, nothing changed behind the user's back: buffers updated once, retries on the batch as given, copies
that can be saved, the user's own checkpointing kept, changes applied whole or not at all, and every budget, name and
count said clearly."""

from __future__ import annotations

import copy
import logging
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt, PeakMemory, VerificationError
from lightning_memopt.memory import CPUPeakTracker
from lightning_memopt.tuning import parse_budget
from tests.helpers import TRAINER_ARGS, NoBlocks, Wrapped, fingerprint, heavy, longer, trainer


class NormStack(pl.LightningModule):
    """A repeated stack of plain-torch blocks with BatchNorm: MemOpt checkpoints it generically."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = lambda: nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())  # noqa: E731
        self.stack = nn.Sequential(*(block() for _ in range(3)))

    def training_step(self, batch, batch_idx):
        return self.stack(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.parametrize("verify", [False, True])
def test_checkpointing_updates_normalisation_statistics_once(verify: bool) -> None:
    plain, model = NormStack(), NormStack()
    trainer(batches=4).fit(plain)
    trainer(MemOpt(verify=verify), batches=4).fit(model)
    assert int(model.stack[0][1].num_batches_tracked) == 4
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    plain.eval(), model.eval()
    x = torch.randn(8, 16)
    torch.testing.assert_close(model.stack(x), plain.stack(x))


def test_verify_compares_buffers(monkeypatch) -> None:
    """A checkpointed path that updates a buffer twice is a difference verify reports."""
    from lightning_memopt.techniques.checkpointing import core

    monkeypatch.setattr(core._Recompute, "__call__", lambda self, *a, **k: self.function(*a, **k))
    with pytest.raises(VerificationError, match=r"the buffer `stack\.0\.1\.(running_mean|running_var|num_batches)"):
        trainer(MemOpt(verify=True), batches=4).fit(NormStack())


class ScalesItsBatch(Wrapped):
    """Scales its batch in place, then runs out of memory the first time a feed-forward sees a whole input."""

    def __init__(self) -> None:
        super().__init__("latte", samples=4)
        self.failed = False
        for module in self.net.modules():
            if type(module).__name__ == "FeedForward":
                module.register_forward_pre_hook(self._maybe_fail)

    def _maybe_fail(self, module, args):
        if not self.failed and type(args[0]).__name__ != "FakeTensor" and args[0].shape[1] == 16:
            self.failed = True
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes")

    def predict_step(self, batch, batch_idx):
        batch["x"].mul_(2)
        return super().predict_step(batch, batch_idx)


def test_a_batch_retried_after_running_out_of_memory_is_the_batch_as_given() -> None:
    class Plain(ScalesItsBatch):
        def _maybe_fail(self, module, args):
            pass

    expected = trainer(batches=2).predict(Plain())
    model = ScalesItsBatch()
    outputs = trainer(MemOpt(chunk_size=16), batches=2).predict(model)
    assert model.failed
    for a, b in zip(outputs, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_longer_inputs_get_the_settings_a_run_of_them_alone_gets() -> None:
    short_then_long = Wrapped("latte", samples=20)
    items = [short_then_long.case.sample(torch.Generator().manual_seed(i)) for i in range(6)]
    items += [longer(Wrapped("latte")).case.sample(torch.Generator().manual_seed(i)) for i in range(14)]
    short_then_long.predict_dataloader = lambda: torch.utils.data.DataLoader(items, batch_size=2)
    mixed, alone = PeakMemory(), PeakMemory()
    trainer(MemOpt(memory_budget=600_000), mixed, batches=10).predict(short_then_long)
    only_long = longer(Wrapped("latte", samples=14))
    trainer(MemOpt(memory_budget=600_000), alone, batches=7).predict(only_long)
    assert mixed.peaks[3:] == alone.peaks  # chosen for the long inputs, not from the short ones' trials
    assert max(mixed.peaks) <= 600_000


def test_a_later_batch_with_other_tensors_is_planned_for_itself() -> None:
    model = Wrapped("latte", samples=6)
    items = [model.case.sample(torch.Generator().manual_seed(i)) for i in range(6)]
    for item in items[2:]:
        item["extra"] = torch.zeros(3)  # the third batch on holds one more tensor
    model.predict_dataloader = lambda: torch.utils.data.DataLoader(items, batch_size=2)
    probe = PeakMemory()
    outputs = trainer(MemOpt(memory_budget=230_000), probe, batches=3).predict(model)
    assert len(outputs) == 3 and max(probe.peaks) <= 230_000  # the batches with the extra tensor too
    plain = trainer(batches=3).predict(model)  # the same model without MemOpt, whose changes are undone
    for a, b in zip(outputs, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class EMA(pl.Callback):
    """Keeps a copy of the model taken when fit starts, as EMA callbacks do."""

    def on_fit_start(self, trainer, pl_module):
        self.copy = copy.deepcopy(pl_module.net)


@pytest.mark.parametrize("case", heavy(["unet2d", "llama", "torch_encoder"], "unet2d"))
def test_a_copy_taken_during_fit_can_be_saved_and_runs_plain(case: str, tmp_path) -> None:
    model, ema = Wrapped(case), EMA()
    trainer(MemOpt(), ema).fit(model)
    torch.save(ema.copy, tmp_path / "ema.pt")  # no local function of a library in it
    loaded = torch.load(tmp_path / "ema.pt", weights_only=False)
    batch = next(iter(model.train_dataloader()))
    plain = copy.deepcopy(Wrapped(case).net)  # never under MemOpt

    def step_peak(net: nn.Module) -> int:
        with CPUPeakTracker() as tracker:
            model.case.forward(net, batch).sum().backward()  # and it trains
        return tracker.peak

    for net in (ema.copy, loaded):
        # a copy holds nothing of MemOpt's: no wrapped forward, and a library's blocks keep the user's flags
        assert _units(net) == []
        assert step_peak(net) == step_peak(plain)


def _units(net: nn.Module) -> list:
    return [getattr(m.__dict__["forward"], "args", [None, None])[1] for m in net.modules() if "forward" in m.__dict__]


def test_the_users_own_diffusers_checkpoint_function_is_kept() -> None:
    calls = []

    def mine(module, *args):
        calls.append(type(module).__name__)
        return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)

    model = Wrapped("unet2d")
    model.net.enable_gradient_checkpointing(gradient_checkpointing_func=mine)
    before = fingerprint(model.net)
    memopt = MemOpt()
    trainer(memopt).fit(model)
    assert calls and memopt.applied[0].method.startswith("already on")
    assert fingerprint(model.net) == before


class Flags(pl.Callback):
    """The layers' checkpointing flags while the batches run."""

    def __init__(self) -> None:
        self.seen: list[list[bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append([bool(layer.__dict__.get("gradient_checkpointing")) for layer in pl_module.net.model.layers])


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_the_users_own_transformers_layer_choice_is_kept() -> None:
    model, flags = Wrapped("llama_long"), Flags()
    model.net.activation_checkpointing_enable(every_n_layers=2)
    chosen = [bool(layer.__dict__.get("gradient_checkpointing")) for layer in model.net.model.layers]
    trainer(MemOpt(), flags).fit(model)
    assert chosen.count(True) == 2 and flags.seen == [chosen, chosen]


def test_a_change_that_fails_halfway_is_undone_and_the_run_goes_on() -> None:
    """A ModuleList holding None (as some diffusers autoencoders have) once broke applying after the library's
    switch had already set its attributes."""
    model = Wrapped("unet2d")
    model.net.down_blocks[0].attentions = nn.ModuleList([None])
    before = fingerprint(model.net)
    fail = model.net.enable_gradient_checkpointing

    def half(*args, **kwargs):
        fail(*args, **kwargs)
        raise AttributeError("'NoneType' object has no attribute '__dict__'")

    model.net.enable_gradient_checkpointing = half
    with pytest.warns(UserWarning, match=r"could not be applied to unet \(UNet2DModel\) \(AttributeError"):
        trainer(MemOpt()).fit(model)
    del model.net.enable_gradient_checkpointing
    assert fingerprint(model.net) == before and not model.net.is_gradient_checkpointing
    with pytest.raises(RuntimeError, match="could not be applied to unet .*`strict=True` makes this an error"):
        model.net.enable_gradient_checkpointing = half
        trainer(MemOpt(strict=True)).fit(model)


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_none_entries_in_module_lists_are_skipped() -> None:
    model = Wrapped("unet2d")
    model.net.down_blocks[0].attentions = nn.ModuleList([None])
    memopt = MemOpt()
    trainer(memopt).fit(model)
    assert memopt.applied and memopt.applied[0].method == "enable_gradient_checkpointing()"


@pytest.mark.parametrize(("value", "expected"), [("0.8", 0.8), ("1", 1.0), ("512B", 512), ("0.5 ", 0.5)])
def test_unitless_budget_strings_are_fractions(value, expected) -> None:
    parsed = parse_budget(value)
    assert parsed == expected and type(parsed) is type(expected)  # "1" is the whole memory, not one byte


@pytest.mark.parametrize("value", ["1.5", "500", "0"])
def test_unitless_budget_strings_that_are_no_fraction_are_refused(value) -> None:
    with pytest.raises(ValueError, match=f"`memory_budget` '{value}'.* has no unit|got '{value}'"):
        MemOpt(memory_budget=value)


@pytest.mark.parametrize(
    ("memopt", "stage", "message"),
    [
        (dict(memory_budget="1GiB", checkpointing=True), "fit", "`checkpointing=True` checkpoints every block in"),
        (dict(memory_budget="1GiB", chunk_size=4), "predict", "`memory_budget` does not choose the settings"),
        pytest.param(
            dict(memory_budget=1000, checkpointing="auto"),
            "fit",
            "not met even with the settings that hold the least",
            marks=pytest.mark.slow,  # heavy: run by CI with -m slow
        ),
        (dict(memory_budget=1000), "predict", "the budget of 1000 B is not met even with the settings that hold"),
    ],
)
def test_budgets_not_used_or_not_met_are_warned_about(memopt, stage, message, caplog) -> None:
    model = Wrapped("deep_encoder" if stage == "fit" else "latte")
    with pytest.warns(UserWarning, match=message):
        run = trainer(MemOpt(measure=False, **memopt), batches=2)
        run.fit(model) if stage == "fit" else run.predict(model)


def test_a_budget_alone_plans_the_blocks_under_it() -> None:
    """``MemOpt(memory_budget=...)`` with nothing else chooses each block's mode under the budget (``checkpointing``
    is then "auto"), where it checkpointed every block in full and warned that the budget chose nothing; without a
    budget every block is checkpointed, as before."""
    import lightning_memopt
    from tests.test_stage import EXAMPLE  # examples/custom_technique.py: a 4-layer encoder

    model = EXAMPLE.Encoder()
    alone = lightning_memopt.estimate(model, model.batch, stage="fit")  # every block checkpointed
    assert alone.how.startswith("checkpointing 4 of 4 blocks"), alone.how
    budget = alone.memopt.bytes + (alone.plain.bytes - alone.memopt.bytes) // 2
    memopt = MemOpt(memory_budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(memopt, batches=3).fit(model)
    assert not [w for w in caught if "whatever `memory_budget`" in str(w.message)], [str(w.message) for w in caught]
    assert memopt.report.peak_bytes <= budget
    assert memopt.report.checkpointed != "4 of 4 blocks", memopt.report.checkpointed  # fewer recomputed under it


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (dict(chekpointing=True), "MemOpt() got an unknown option `chekpointing`; did you mean `checkpointing`?"),
        (dict(memory_budget="1GiB", lossyy=True), "unknown option `lossyy`; did you mean `lossy`?"),
        (dict(speed=2), "unknown option `speed`; the options are checkpointing, chunked_loss, "),
    ],
)
def test_a_misspelt_option_is_refused_naming_the_closest(given, message) -> None:
    """Python said only "got an unexpected keyword argument"; MemOpt's signature, which LightningCLI reads, is
    unchanged."""
    import inspect

    from lightning_memopt import estimate
    from lightning_memopt.engine.config import MemOptConfig

    with pytest.raises(TypeError, match=re.escape(message)):
        MemOpt(**given)
    with pytest.raises(TypeError, match=re.escape(message.replace("MemOpt()", "estimate()"))):
        estimate(Wrapped("deep_encoder"), torch.zeros(1), "fit", **given)
    assert tuple(inspect.signature(MemOpt).parameters) == MemOptConfig.names()


def test_block_names_that_match_nothing_are_an_error_naming_them() -> None:
    with pytest.raises(ValueError, match=r"\['LlamaDecoderLayr'\], which match no module .* \['LlamaDecoderLayer'\]"):
        trainer(MemOpt(checkpoint_blocks=["LlamaDecoderLayr"])).fit(Wrapped("llama"))
    memopt = MemOpt(checkpoint_blocks=["llamadecoderlayer"])  # the case does not matter
    trainer(memopt).fit(Wrapped("llama"))
    assert memopt.applied[0].blocks == 2


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_block_counts_agree(caplog) -> None:
    memopt = MemOpt()
    with caplog.at_level(logging.INFO):
        trainer(memopt).fit(Wrapped("llama_long"))
    assert memopt.applied[0].blocks == 4 and "(4 blocks)" in caplog.text
    unet = MemOpt(checkpointing="auto", memory_budget="1GiB")
    trainer(unet).fit(Wrapped("unet2d"))
    checkpointing = next(a for a in unet.report.set_up if a.technique == "checkpointing")  # set up, maybe not in force
    assert unet.report.checkpointed.endswith(f"of {checkpointing.blocks} blocks")
    from diffusers import DiTTransformer2DModel

    one = Wrapped("dit")  # a transformer whose stack holds one block: one flag on the model checkpoints it
    one.transformer = DiTTransformer2DModel(**{**dict(one.net.config), "num_layers": 1})
    memopt = MemOpt()
    trainer(memopt).fit(one)
    assert memopt.applied[0].blocks == 1 and memopt.report.saved_bytes > 0


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_predict_reports_no_checkpointing_and_a_run_with_nothing_measured_says_so() -> None:
    memopt = MemOpt(checkpointing="auto", memory_budget="1GiB", chunk_size=2)
    t = trainer(memopt)
    t.fit(Wrapped("unet2d"))
    t.predict(Wrapped("latte"))
    report = memopt.report
    assert report.stage == "predict" and report.checkpointed is None and "checkpoint" not in str(report)

    class Skips(Wrapped):  # every step skipped, so no batch can be measured
        def training_step(self, batch, batch_idx):
            return None

        def on_train_batch_end(self, outputs, batch, batch_idx):
            pass

    quiet = MemOpt(checkpointing="auto", memory_budget="1GiB", chunk_size=2)
    trainer(quiet).fit(Skips("unet2d"))
    assert quiet.report.batch_idx is None
    assert "nothing measured" in str(quiet.report) and "batch None" not in str(quiet.report)


def test_strict_errors_do_not_say_the_model_runs_unchanged() -> None:
    with pytest.raises(RuntimeError) as error:
        pl.Trainer(**TRAINER_ARGS, limit_train_batches=1, callbacks=[MemOpt(strict=True)]).fit(NoBlocks())
    assert "it is skipped and runs unchanged" not in str(error.value)


def test_keyword_arguments_reach_blocks_checkpointed_by_the_library_switch() -> None:
    """A diffusers model that passes a keyword argument to its checkpoint function (as WanAnimate2Transformer3DModel
    passes ``kv_cache``): diffusers' own function takes none; MemOpt's passes them on."""
    from diffusers import ModelMixin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x, scale=None):
            return x + scale * self.proj(x)

    class Model(ModelMixin):
        _supports_gradient_checkpointing = True

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.gradient_checkpointing = False

        def forward(self, x):
            for block in self.blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    x = self._gradient_checkpointing_func(block, x, scale=0.5)
                else:
                    x = block(x, scale=0.5)
            return x

    model = Wrapped("torch_encoder")
    model.encoder = Model()
    memopt = MemOpt(verify=True)
    trainer(memopt).fit(model)
    assert memopt.report.peak_bytes is not None and memopt.applied[0].method == "enable_gradient_checkpointing()"


def test_a_predict_step_without_batch_idx_is_called_as_the_user_wrote_it() -> None:
    """Lightning passes ``batch_idx`` only to a ``predict_step`` that takes it; MemOpt's wrapper keeps the signature."""

    class NoIndex(Wrapped):
        def predict_step(self, batch):
            return self.case.forward(self.net, batch)

    plain = trainer().predict(NoIndex("latte"))
    chunked = trainer(MemOpt(chunk_size=2)).predict(NoIndex("latte"))
    for a, b in zip(chunked, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
