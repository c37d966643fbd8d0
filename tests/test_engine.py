"""The engine's contracts: one frozen config, techniques as plug-ins of a registry, and "without" seen by switching
units off (never by applying a library's switch again)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt, estimate
from lightning_memopt.adapters import find_models
from lightning_memopt.callbacks.memopt import STATE_VERSION
from lightning_memopt.engine import MemOptConfig
from lightning_memopt.engine.changes import Changes
from lightning_memopt.handles import AttributeOverride
from lightning_memopt.techniques import Change, Technique, register_technique, unregister_technique
from lightning_memopt.techniques.checkpointing import Checkpointing
from lightning_memopt.techniques.chunking import Chunking

TRAINER = dict(
    accelerator="cpu", max_epochs=1, limit_train_batches=2, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)  # fmt: skip


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def batches(n: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader([torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)], batch_size=None)


# one config ----------------------------------------------------------------------------------------------------------


def test_one_frozen_config_shared_by_the_callback_and_estimate() -> None:
    callback = MemOpt(memory_budget="2KiB", models=["model"], verify=True)
    assert callback.config == MemOptConfig(memory_budget=2048, models=("model",), verify=True)
    assert callback.memory_budget == 2048 and callback.verify  # the options read as attributes too
    with pytest.raises(dataclasses.FrozenInstanceError):
        callback.config.chunk_size = 4  # type: ignore[misc]
    assert callback.config.replace(chunk_size=4).chunk_size == 4 and callback.config.chunk_size == "auto"
    # the same validation, and the same message, from each entry point
    for build in (MemOpt, MemOptConfig, lambda **kw: estimate(LM(), next(iter(batches(1))), **kw)):
        with pytest.raises(ValueError, match=r"`chunk_size` must be a positive int or 'auto', got -3"):
            build(chunk_size=-3)
        with pytest.raises(ValueError, match=r"`models` must be a non-empty list of names or None, got 'model'"):
            build(models="model")


def test_disabled_means_no_technique_at_all() -> None:
    config = MemOptConfig(enabled=False, checkpointing="auto", chunking=True)
    assert (config.checkpointing, config.chunking) == (False, False)


# "without" by switching off --------------------------------------------------------------------------------------


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_the_baseline_switches_units_off_and_never_calls_the_library_switch_again(monkeypatch) -> None:
    """Measuring the step without MemOpt's changes (the baseline dry run, verify's run, the count search) used to
    undo the changes and apply them again: the library's switch ran again each time. It runs once now."""
    from transformers import PreTrainedModel

    calls = []
    original = PreTrainedModel.activation_checkpointing_enable

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "activation_checkpointing_enable", counted)
    module = LM()
    callback = MemOpt(checkpointing="auto", memory_budget=10**9, verify=True)
    pl.Trainer(**TRAINER, callbacks=[callback]).fit(module, batches())
    report = callback.report
    assert report is not None and report.baseline_peak_bytes is not None and report.peak_bytes is not None
    assert calls == ["LlamaForCausalLM"]  # once, for the whole fit: dry runs, verify and count search included
    assert not any(m.__dict__.get("gradient_checkpointing") for m in module.modules())  # and undone at the end


def test_off_switches_every_unit_off_and_back_with_its_settings() -> None:
    root = nn.Module()
    root.model = llama()
    changes = Changes("fit", find_models(root), MemOptConfig(), lambda note: None)
    changes.apply(quiet=True)
    checkpointing = changes.technique(Checkpointing)
    checkpointing.enable(2)
    on = [u.enabled for u in checkpointing.switches]
    assert sum(on) == 2 and len(on) == 4 and changes.changed
    with changes.off():
        assert not changes.changed
        assert not any(m.__dict__.get("gradient_checkpointing") for m in root.modules())
    assert [u.enabled for u in checkpointing.switches] == on
    changes.remove()
    assert not any("gradient_checkpointing" in m.__dict__ and m.gradient_checkpointing for m in root.modules())

    loop = Changes("predict", find_models(root), MemOptConfig(chunk_size=4), lambda note: None)
    loop.apply(quiet=True)
    settings = loop.technique(Chunking).in_force()
    assert settings and loop.changed
    with loop.off():
        assert not loop.changed and all(s.size is None for s in loop.technique(Chunking).in_force().values())
    assert loop.technique(Chunking).in_force() == settings
    loop.remove()


# a technique is a plug-in -----------------------------------------------------------------------------------------


class Toy(Technique):
    """A technique in a few lines: it marks each model, and the mark is its setting."""

    name = "toy"
    stages = ("predict",)
    offs: list[int] = []  # each off(): how many models it switched off

    def __init__(self) -> None:
        self.marked: list[nn.Module] = []
        self.handles: list[AttributeOverride] = []

    def apply(self, found: Any, config: MemOptConfig) -> Change:
        self.handles.append(AttributeOverride(found.module, "toy_mark", True))
        self.marked.append(found.module)
        return Change("a mark", 1, self.handles[-1])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.marked = [], []

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        Toy.offs.append(len(self.marked))
        for module in self.marked:
            module.toy_mark = False
        try:
            yield
        finally:
            for module in self.marked:
                module.toy_mark = True

    @property
    def changed(self) -> bool:
        return any(m.toy_mark for m in self.marked)

    def describe(self) -> str | None:
        return f"{len(self.marked)} marked"

    def state(self) -> dict[str, Any]:
        return {"marked": len(self.marked)}

    def load(self, state: dict[str, Any]) -> bool:
        return state.get("marked") == len(self.marked)


@pytest.fixture
def toy() -> Iterator[type[Toy]]:
    register_technique(Toy)
    try:
        yield Toy
    finally:
        unregister_technique(Toy)


def test_a_registered_technique_is_applied_reported_switched_off_and_undone(toy, monkeypatch) -> None:
    monkeypatch.setattr(Toy, "offs", [])
    module = LM()
    seen = []

    class Probe(pl.Callback):
        def on_predict_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            seen.append(pl_module.model.__dict__.get("toy_mark"))

    callback = MemOpt()
    outputs = pl.Trainer(**TRAINER, callbacks=[callback, Probe()]).predict(module, batches())
    assert outputs is not None and len(outputs) == 2
    assert seen == [True, True]  # in force in every batch
    assert Toy.offs and all(n == 1 for n in Toy.offs)  # switched off for the dry runs without the changes, then back
    report = callback.report
    assert report is not None and ("toy", "a mark") in {(a.technique, a.method) for a in report.applied}
    assert "toy_mark" not in module.model.__dict__  # undone when the loop ended
    saved = callback.state_dict()["settings"]["predict"]
    assert saved and all(states["toy"] == {"marked": 1} for _, states in saved)  # its state kept for a resumed run


def test_the_state_has_a_version_and_a_state_of_another_layout_is_chosen_again_with_a_warning() -> None:
    """One layout, with a version key: a state saved in it round-trips; one without it (an unreleased layout) or of
    another version is not read, and a warning says the settings are chosen again."""
    settings = {"fit": [[[[2, 16]], {"checkpointing": {"switches": ["model.layers.0"], "modes": ["full"]}}]]}
    callback = MemOpt()
    callback.load_state_dict({"version": STATE_VERSION, "settings": settings})
    assert callback.state_dict() == {"version": STATE_VERSION, "settings": settings}
    older = {"checkpointing": {}, "chunk_settings": {"predict": [[[[2, 16]], {"model.layers.0": [1, 4, 4]}, {}]]}}
    for state in (older, {"version": STATE_VERSION + 1, "settings": settings}):
        with pytest.warns(UserWarning, match=r"MemOpt state has version .* chosen again by dry runs"):
            callback.load_state_dict(state)
        assert callback.state_dict() == {"version": STATE_VERSION, "settings": {}}
