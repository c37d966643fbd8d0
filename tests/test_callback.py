"""MemOpt's contract: clear errors, one warning per skipped model, exact restoration even after an exception."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt
from lightning_memopt.adapters import FoundModel, find_models
from lightning_memopt.adapters.hf_transformers import TransformersAdapter
from lightning_memopt.compat import strategy_checkpoints as _strategy_checkpoints
from lightning_memopt.techniques import CheckpointConfig
from lightning_memopt.techniques.checkpointing.technique import checkpoint_model
from tests import zoo
from tests.helpers import NoBlocks, Wrapped, fingerprint, trainer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_size": 0}, "`chunk_size` must be a positive int or 'auto', got 0"),
        ({"chunk_size": "big"}, "`chunk_size` must be a positive int or 'auto', got 'big'"),
        ({"chunk_size": True}, "`chunk_size` must be a positive int or 'auto', got True"),
        ({"chunk_dim": 2}, "`chunk_dim` must be 0 (batch) or 1 (sequence), got 2"),
        ({"chunk_dim": True}, "`chunk_dim` must be 0 (batch) or 1 (sequence), got True"),
        ({"chunk_dim": 1.0}, "`chunk_dim` must be 0 (batch) or 1 (sequence), got 1.0"),
        ({"verify_tolerance": float("nan")}, "`verify_tolerance` must be a non-negative finite number, got nan"),
        ({"checkpointing": "yes"}, "`checkpointing` must be True, False, 'auto' or 'offload', got 'yes'"),
        ({"checkpointing": 1}, "`checkpointing` must be True, False, 'auto' or 'offload', got 1"),
        ({"optimizer_in_backward": "cpu"}, "`optimizer_in_backward` must be True, False, 'auto' or 'host', got 'cpu'"),
        (
            {"optimizer_in_backward": "host", "optimizer_state_8bit": True, "lossy": True},
            "`optimizer_in_backward='host'` keeps the optimizer state in host memory, in full, and "
            "`optimizer_state_8bit=True` keeps it in 8 bits on the device: pass one of them",
        ),
        ({"strict": 1}, "`strict` must be True or False, got 1"),
        ({"models": "unet"}, "`models` must be a non-empty list of names or None, got 'unet'"),
        ({"models": []}, "`models` must be a non-empty list of names or None, got []"),
        ({"checkpoint_blocks": [3]}, "`checkpoint_blocks` must be a non-empty list of names or None, got [3]"),
    ],
)
def test_bad_arguments_raise_naming_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        MemOpt(**kwargs)
    assert message in str(error.value)


def test_unsupported_model_warns_once_and_runs_unchanged() -> None:
    model = NoBlocks()
    before = fingerprint(model.head)
    memopt = MemOpt()
    with pytest.warns(UserWarning, match=r"head \(Sequential\) has no blocks MemOpt can use for checkpointing") as rec:
        trainer(memopt).fit(model)
    assert sum("MemOpt" in str(w.message) for w in rec) == 1
    assert [a.technique for a in memopt.applied] == ["free_gradients"]  # the optimizer's part: the model unchanged
    assert fingerprint(model.head) == before
    with pytest.warns(UserWarning, match=r"head \(Sequential\) has no blocks MemOpt can use for chunking"):
        trainer(memopt).predict(model)


def test_strict_turns_the_warning_into_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"head \(Sequential\) has no blocks.*`strict=True`"):
        trainer(MemOpt(strict=True)).fit(NoBlocks())


class Boom(pl.Callback):
    def __init__(self, exception: BaseException) -> None:
        self.exception = exception
        self.seen_checkpointing = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen_checkpointing = pl_module.net.is_gradient_checkpointing
        raise self.exception


def test_model_is_restored_after_an_exception() -> None:
    model = Wrapped("unet2d")
    before = fingerprint(model.net)
    boom = Boom(RuntimeError("user code failed"))
    with pytest.raises(RuntimeError, match="user code failed"):
        trainer(MemOpt(), boom).fit(model)
    assert boom.seen_checkpointing
    assert fingerprint(model.net) == before and not model.net.is_gradient_checkpointing


def test_model_is_restored_after_keyboard_interrupt() -> None:
    model = Wrapped("unet2d")
    before = fingerprint(model.net)
    boom = Boom(KeyboardInterrupt())
    with pytest.raises(SystemExit):  # Lightning turns Ctrl+C into a graceful exit
        trainer(MemOpt(), boom).fit(model)
    assert boom.seen_checkpointing
    assert fingerprint(model.net) == before


def test_checkpointing_the_user_switched_on_stays_on() -> None:
    model = Wrapped("llama")
    model.net.activation_checkpointing_enable()
    before = fingerprint(model.net)
    trainer(MemOpt()).fit(model)
    assert model.net.is_activation_checkpointing
    assert fingerprint(model.net) == before


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_models_argument_restricts_the_search() -> None:
    model = Wrapped("unet2d")
    model.encoder = zoo.torch_encoder()
    memopt = MemOpt(models=["encoder"])
    trainer(memopt).fit(model)
    assert {a.model for a in memopt.applied} == {"encoder (TransformerEncoder)"}
    with pytest.raises(ValueError, match=r"`models` names \['vae'\], which are not submodules; choose from"):
        trainer(MemOpt(models=["vae"])).fit(Wrapped("unet2d"))


def test_models_created_in_configure_model_are_found() -> None:
    class Late(Wrapped):
        def __init__(self) -> None:
            super().__init__("torch_encoder")
            del self.encoder

        def configure_model(self) -> None:
            if not hasattr(self, "encoder"):
                self.encoder = zoo.torch_encoder()

    memopt = MemOpt()
    trainer(memopt).fit(Late())
    assert {a.model for a in memopt.applied} == {"encoder (TransformerEncoder)"}


def test_frozen_models_are_not_checkpointed() -> None:
    model = Wrapped("unet2d")
    model.encoder = zoo.torch_encoder().requires_grad_(False)
    memopt = MemOpt()
    trainer(memopt).fit(model)
    assert {a.model for a in memopt.applied} == {"unet (UNet2DModel)"}


def test_discovery_finds_nested_and_wrapped_models() -> None:
    root = nn.Module()
    root.pipeline = nn.Module()
    root.pipeline.unet = zoo.unet2d()
    root.pipeline.text = zoo.bert()
    root.encoder = zoo.torch_encoder()
    labels = [m.label for m in find_models(root)]
    assert labels == [
        "pipeline.unet (UNet2DModel)",
        "pipeline.text (BertForMaskedLM)",
        "pipeline (Module)",
        "encoder (TransformerEncoder)",
    ]


def test_explicit_block_classes_use_the_generic_technique() -> None:
    model = Wrapped("llama")
    memopt = MemOpt(checkpoint_blocks=["LlamaDecoderLayer"])
    trainer(memopt).fit(model)
    assert memopt.applied[0].method == "generic checkpoint of LlamaDecoderLayer"
    assert memopt.applied[0].blocks == 2


def test_transformers_switch_raises_no_deprecation_warning() -> None:
    model = zoo.llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        change = checkpoint_model(FoundModel("model", model, TransformersAdapter()), CheckpointConfig())
    assert change is not None and change.method == "activation_checkpointing_enable()"
    assert model.is_activation_checkpointing
    change.handle.remove()
    assert not model.is_activation_checkpointing


def test_strategies_that_checkpoint_themselves_are_left_alone() -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    assert _strategy_checkpoints(FSDPStrategy(activation_checkpointing_policy={nn.TransformerEncoderLayer})) == (
        "FSDPStrategy"
    )
    assert _strategy_checkpoints(FSDPStrategy()) is None
    assert _strategy_checkpoints(DDPStrategy()) is None


def test_fsdp_checkpointing_is_not_wrapped_twice(monkeypatch) -> None:
    model = Wrapped("torch_encoder")
    memopt = MemOpt()
    t = trainer(memopt)
    owner = "lightning_memopt.techniques.checkpointing.technique.strategy_checkpoints"
    monkeypatch.setattr(owner, lambda strategy: "FSDPStrategy")
    with pytest.warns(UserWarning, match="FSDPStrategy already checkpoints activations"):
        t.fit(model)
    assert [a for a in memopt.applied if a.technique == "checkpointing"] == []


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_import_needs_no_optional_library() -> None:
    """diffusers and peft are hidden here. transformers cannot be hidden in this process, since torchmetrics imports
    it when it is installed; `.ci/run` also imports the package in a virtual environment without any of the three."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('diffusers', 'peft'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lightning_memopt\n"
        "from lightning_memopt import MemOpt\n"
        "MemOpt()\n"
        "assert not {'diffusers', 'peft'} & set(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_diffusers_model_without_the_switch_gets_the_generic_technique() -> None:
    from diffusers import ModelMixin

    class NoSwitch(ModelMixin):
        _supports_gradient_checkpointing = False

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    net = NoSwitch()
    change = find_models_and_checkpoint(net)
    assert change.method == "generic checkpoint of Sequential" and change.blocks == 3
    change.handle.remove()
    assert all("forward" not in b.__dict__ for b in net.blocks)


def find_models_and_checkpoint(net: nn.Module):
    root = nn.Module()
    root.net = net
    (found,) = find_models(root)
    assert found.adapter.name == "diffusers"
    return checkpoint_model(found, CheckpointConfig())


def test_deepspeed_activation_checkpointing_is_detected() -> None:
    class DeepSpeedStrategy:  # stands in for Lightning's class, which needs deepspeed installed to be used
        def __init__(self, partition: bool) -> None:
            self.config = {"activation_checkpointing": {"partition_activations": partition, "cpu_checkpointing": False}}

    assert _strategy_checkpoints(DeepSpeedStrategy(partition=True)) == "DeepSpeedStrategy"
    assert _strategy_checkpoints(DeepSpeedStrategy(partition=False)) is None


def test_only_frozen_models_is_not_reported_as_no_model() -> None:
    model = Wrapped("torch_encoder")
    model.encoder.requires_grad_(False)
    model.head = nn.Linear(32, 32)  # a leaf with the only trainable weights
    model.case = dataclasses.replace(model.case, forward=lambda m, b: model.head(m(b["x"])))
    memopt = MemOpt()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="MemOpt")
        trainer(memopt).fit(model)
    assert memopt.applied == []


def test_a_module_without_any_model_warns_naming_the_lightning_module() -> None:
    class Empty(NoBlocks):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 1)  # a leaf: not a model MemOpt looks into

    with pytest.warns(UserWarning, match="Empty contains no model MemOpt can use for checkpointing"):
        trainer(MemOpt()).fit(Empty())


class NeedsCheckpointing(pl.LightningModule):
    """Runs out of memory above 4 samples a batch, or above 16 when its encoder is checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        self.encoder = zoo.torch_encoder()

    def training_step(self, batch, batch_idx):
        checkpointed = "forward" in self.encoder.layers[0].__dict__
        if len(batch[0]) > (16 if checkpointed else 4):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes")
        return self.encoder(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, 32))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


@pytest.mark.slow  # heavy: run by CI with -m slow
@pytest.mark.parametrize("with_memopt", [False, True])
def test_batch_size_finder_searches_with_checkpointing_in_force(with_memopt: bool) -> None:
    from lightning.pytorch.callbacks import BatchSizeFinder

    model = NeedsCheckpointing()
    finder = BatchSizeFinder(mode="power", init_val=2, max_trials=6, steps_per_trial=1, margin=0.0)
    callbacks = [finder, MemOpt()] if with_memopt else [finder]
    t = trainer(*callbacks)
    t.fit(model)
    assert finder.optimal_batch_size == (16 if with_memopt else 4)
