"""LightningModules around the tiny models, and probes that record loss, gradients and exact CPU peak memory."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests import zoo

B = 2


def dry_runs_in_plan(monkeypatch: pytest.MonkeyPatch, technique: type) -> list[str]:
    """The dry runs ``technique``'s ``plan`` makes from now on (one entry each), counted by patching it."""
    runs: list[str] = []
    plan = technique.plan

    def counted(self: Any, planning: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            runs.append("run")
            return planning.run(*args, **kwargs)

        return plan(self, dataclasses.replace(planning, run=run))

    monkeypatch.setattr(technique, "plan", counted)
    return runs


def heavy(cases: Any, *slow: Any, group: str | None = None, grouped: Any = None) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize``, those in ``slow`` marked slow: the default run leaves them to CI's
    ``python -m pytest -m slow``, each capability keeping a lighter case in the default run. With ``group``, each case
    of ``grouped`` (every case if not given) is also in the xdist group ``<group>_<case>``: the tests that read its
    runs go to one worker, which computes them once."""
    unknown = set(slow) - set(cases)
    assert not unknown, f"not among the cases: {sorted(unknown)}"
    grouped = cases if grouped is None else grouped

    def marks(case: Any) -> list[Any]:
        shared = [pytest.mark.xdist_group(f"{group}_{case}")] if group and case in grouped else []
        return shared + [pytest.mark.slow] * (case in slow)

    return [pytest.param(c, marks=marks(c)) for c in cases]


def once(make: Callable[..., Any]) -> Callable[..., Any]:
    """``make``, called once: later calls return its first result, whatever their arguments (such as pytest's
    ``tmp_path_factory``, which cannot be a key of ``functools.cache``)."""
    results: list[Any] = []

    @functools.wraps(make)
    def cached(*args: Any, **kwargs: Any) -> Any:
        if not results:
            results.append(make(*args, **kwargs))
        return results[0]

    return cached


def _lora(model: nn.Module, targets: list[str]) -> nn.Module:
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return model


def _peft_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    return get_peft_model(zoo.llama(), cfg)


def _sample(out: Any) -> torch.Tensor:
    return out.sample if hasattr(out, "sample") else out[0]


def _mse(out: torch.Tensor, b: Batch) -> torch.Tensor:
    return nn.functional.mse_loss(out[:, : b["x"].shape[1]], b["x"])


def _lm_loss(out: torch.Tensor, b: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), b["ids"].flatten())


def _ids(g: torch.Generator) -> Batch:
    return {"ids": torch.randint(0, 128, (32,), generator=g)}


Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """A tiny model under an attribute, a synthetic sample, the forward pass and the loss."""

    attr: str
    factory: Callable[[], nn.Module]
    sample: Callable[[torch.Generator], Batch]
    forward: Callable[[nn.Module, Batch], torch.Tensor]
    loss: Callable[[torch.Tensor, Batch], torch.Tensor]


CASES: dict[str, Case] = {
    "unet2d": Case(
        "unet",
        zoo.unet2d,
        lambda g: {"x": torch.randn(3, 16, 16, generator=g), "t": torch.randint(0, 10, (), generator=g)},
        lambda m, b: _sample(m(b["x"], b["t"])),
        _mse,
    ),
    "unet2d_condition_lora": Case(
        "unet",
        lambda: _lora(zoo.unet2d_condition(), ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"]),
        lambda g: {"x": torch.randn(4, 16, 16, generator=g), "c": torch.randn(5, 16, generator=g)},
        lambda m, b: _sample(m(b["x"], 3, encoder_hidden_states=b["c"])),
        _mse,
    ),
    "unet2d_condition": Case(
        "unet",
        zoo.unet2d_condition,
        lambda g: {"x": torch.randn(4, 16, 16, generator=g), "c": torch.randn(5, 16, generator=g)},
        lambda m, b: _sample(m(b["x"], 3, encoder_hidden_states=b["c"])),
        _mse,
    ),
    "dit": Case(
        "transformer",
        zoo.dit,
        lambda g: {"x": torch.randn(4, 16, 16, generator=g), "y": torch.randint(0, 10, (), generator=g)},
        lambda m, b: _sample(m(b["x"], timestep=b["y"], class_labels=b["y"])),
        _mse,
    ),
    "sd3": Case(
        "transformer",
        zoo.sd3,
        lambda g: {
            "x": torch.randn(4, 16, 16, generator=g),
            "c": torch.randn(5, 16, generator=g),
            "p": torch.randn(8, generator=g),
        },
        lambda m, b: _sample(
            m(b["x"], encoder_hidden_states=b["c"], pooled_projections=b["p"], timestep=torch.ones(len(b["x"])))
        ),
        _mse,
    ),
    "latte": Case(
        "transformer",
        zoo.latte,
        lambda g: {"x": torch.randn(4, 3, 8, 8, generator=g), "c": torch.randn(5, 16, generator=g)},
        lambda m, b: _sample(
            m(b["x"], timestep=torch.ones(len(b["x"]), device=b["x"].device).long(), encoder_hidden_states=b["c"])
        ),
        _mse,
    ),
    "svd_unet": Case(
        "unet",
        zoo.svd_unet,
        lambda g: {
            "x": torch.randn(3, 8, 8, 8, generator=g),
            "c": torch.randn(1, 16, generator=g),
            "a": torch.randn(3, generator=g),
        },
        lambda m, b: _sample(m(b["x"], 3, encoder_hidden_states=b["c"], added_time_ids=b["a"])),
        lambda out, b: nn.functional.mse_loss(out, b["x"][:, :, : out.shape[2]]),
    ),
    "flux": Case(
        "transformer",
        zoo.flux,
        lambda g: {"x": torch.randn(64, 4, generator=g), "c": torch.randn(5, 16, generator=g), "p": torch.randn(8)},
        lambda m, b: (
            m(
                hidden_states=b["x"],
                encoder_hidden_states=b["c"],
                pooled_projections=b["p"],
                timestep=torch.ones(len(b["x"])),
                img_ids=torch.zeros(b["x"].shape[1], 3),
                txt_ids=torch.zeros(b["c"].shape[1], 3),
            ).sample
        ),
        lambda out, b: nn.functional.mse_loss(out, b["x"]),
    ),
    "wan": Case(
        "transformer",
        zoo.wan,
        lambda g: {"x": torch.randn(4, 2, 8, 8, generator=g), "c": torch.randn(5, 16, generator=g)},
        lambda m, b: m(hidden_states=b["x"], timestep=torch.ones(len(b["x"])), encoder_hidden_states=b["c"]).sample,
        _mse,
    ),
    "llama": Case("model", zoo.llama, _ids, lambda m, b: m(input_ids=b["ids"]).logits, _lm_loss),
    "llama_long": Case(
        "model",
        lambda: zoo.llama(layers=4, hidden=64),
        lambda g: {"ids": torch.randint(0, 128, (256,), generator=g)},
        lambda m, b: m(input_ids=b["ids"]).logits,
        _lm_loss,
    ),
    "bert": Case("model", zoo.bert, _ids, lambda m, b: m(input_ids=b["ids"]).logits, _lm_loss),
    "peft_llama": Case("model", _peft_llama, _ids, lambda m, b: m(input_ids=b["ids"]).logits, _lm_loss),
    "deep_encoder": Case(
        "encoder",
        lambda: zoo.torch_encoder(layers=8),
        lambda g: {"x": torch.randn(64, 32, generator=g)},
        lambda m, b: m(b["x"]),
        lambda out, b: out.pow(2).mean(),
    ),
    "torch_encoder": Case(
        "encoder",
        zoo.torch_encoder,
        lambda g: {"x": torch.randn(32, 32, generator=g)},
        lambda m, b: m(b["x"]),
        lambda out, b: out.pow(2).mean(),
    ),
}
#: The training cases of the core issue, and the predict cases.
FIT_CASES = ["unet2d", "unet2d_condition_lora", "dit", "sd3", "llama", "bert", "peft_llama", "torch_encoder"]
PREDICT_CASES = ["latte", "svd_unet", "bert"]


class Synthetic(Dataset):
    def __init__(self, make: Callable[[torch.Generator], Batch], n: int = 8) -> None:
        self.items = [make(torch.Generator().manual_seed(i)) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Batch:
        return self.items[i]


class Wrapped(pl.LightningModule):
    """A LightningModule holding one tiny model under the attribute the case names."""

    def __init__(self, case: str, seed: int = 0, samples: int = 8) -> None:
        super().__init__()
        self.case = CASES[case]
        self.samples = samples
        torch.manual_seed(seed)
        setattr(self, self.case.attr, self.case.factory())
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.outputs: list[torch.Tensor] = []

    @property
    def net(self) -> nn.Module:
        return getattr(self, self.case.attr)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.case.loss(self.case.forward(self.net, batch), batch)

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())  # here, not in training_step: a dry run cannot give .item()

    def on_after_backward(self) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.case.forward(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Synthetic(self.case.sample, self.samples), batch_size=B)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(Synthetic(self.case.sample, self.samples), batch_size=B)


@dataclass(frozen=True)
class Fitted:
    """A fit of a case's :class:`Wrapped` under ``MemOpt()`` with a ``PeakMemory`` probe after it: the model as the
    fit left it, its fingerprint from before, the probe and the callback."""

    model: Wrapped
    before: dict[str, Any]
    probe: Any
    memopt: Any


@functools.cache
def memopt_fit(case: str) -> Fitted:
    """The fit of ``case`` under ``MemOpt()`` (before the probe, which must not count MemOpt's dry run on the measured
    batch), two batches: run once per process, for every test that reads it (they only read it)."""
    from lightning_memopt import MemOpt, PeakMemory

    model, probe, memopt = Wrapped(case), PeakMemory(), MemOpt()
    before = fingerprint(model.net)
    trainer(memopt, probe).fit(model)
    return Fitted(model, before, probe, memopt)


def longer(model: Wrapped) -> Wrapped:
    """Latte videos of 16x16 latents instead of 8x8: four times the tokens."""
    sample = lambda g: {"x": torch.randn(4, 3, 16, 16, generator=g), "c": torch.randn(5, 16, generator=g)}  # noqa: E731
    model.case = type(model.case)(model.case.attr, model.case.factory, sample, model.case.forward, model.case.loss)
    return model


class NoBlocks(pl.LightningModule):
    """A model MemOpt cannot help: no block stacks, no feed-forward modules."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.head(batch[0]).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        return self.head(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)

    predict_dataloader = train_dataloader


class DecodeLatents(pl.LightningModule):
    """Decodes batches of latents with a VAE, as a sampler's last step does."""

    def __init__(self, vae: nn.Module, latents: torch.Tensor, batch_size: int = 2) -> None:
        super().__init__()
        self.vae, self.latents, self.batch_size = vae, latents, batch_size

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.vae.decode(batch).sample

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.latents, batch_size=self.batch_size)


class Diffusion(pl.LightningModule):
    """Trains a Latte-style transformer to predict noise, and samples in validation_step and test_step: two denoising
    steps, then the VAE decode of every frame."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer, self.vae = zoo.latte(), zoo.vae()
        self.vae.requires_grad_(False)
        self.samples: dict[str, list[torch.Tensor]] = {"validate": [], "test": []}

    def denoise(self, x: torch.Tensor, c: torch.Tensor, t: int) -> torch.Tensor:
        steps = torch.full((len(x),), t)
        return self.transformer(x, timestep=steps, encoder_hidden_states=c).sample[:, :4]

    def training_step(self, batch, batch_idx):
        noise = torch.randn(batch["x"].shape, generator=torch.Generator().manual_seed(batch_idx))
        return torch.nn.functional.mse_loss(self.denoise(batch["x"] + noise, batch["c"], 10), noise)

    def sample(self, batch, stage: str) -> torch.Tensor:
        x = batch["x"]
        for t in (20, 10):
            x = x - 0.1 * self.denoise(x, batch["c"], t)
        frames = self.vae.decode(x.transpose(1, 2).flatten(0, 1)).sample
        self.samples[stage].append(frames)
        self.log(f"{stage}_mean", frames.mean())
        return frames

    def validation_step(self, batch, batch_idx):
        return self.sample(batch, "validate")

    def test_step(self, batch, batch_idx):
        return self.sample(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.transformer.parameters(), lr=0.01)

    def _data(self):
        g = torch.Generator().manual_seed(0)
        items = [{"x": torch.randn(4, 3, 24, 24, generator=g), "c": torch.randn(5, 16, generator=g)} for _ in range(4)]
        return torch.utils.data.DataLoader(items, batch_size=2)

    def train_dataloader(self):
        return self._data()

    def val_dataloader(self):
        return self._data()

    def test_dataloader(self):
        return self._data()


TRAINER_ARGS = dict(
    accelerator="cpu",
    devices=1,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
#: For the validation and test loops of :class:`Diffusion`: two batches each, no sanity check.
LOOP_ARGS = {**TRAINER_ARGS, "limit_train_batches": 2, "limit_val_batches": 2, "num_sanity_val_steps": 0}


def trainer(*callbacks: pl.Callback, batches: int = 2) -> pl.Trainer:
    return pl.Trainer(
        **TRAINER_ARGS, limit_train_batches=batches, limit_predict_batches=batches, callbacks=list(callbacks)
    )


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """Every module's instance attributes (values for plain ones, identity for the rest) and hook counts.

    ``training`` is left out: Lightning, not MemOpt, switches train and eval mode.
    """
    plain = (bool, int, float, str, type(None))
    result: dict[str, Any] = {}
    for name, module in model.named_modules():
        attrs = {}
        for key, value in module.__dict__.items():
            if key in ("training", "_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, dict) and key.startswith("_") and "hook" in key:
                attrs[key] = tuple(value.keys())
            elif isinstance(value, plain):
                attrs[key] = value
            else:
                attrs[key] = id(value)
        result[name] = attrs
    return result


def scaled_model(broken: bool):
    """A diffusers model whose checkpointed path drops the `scale` argument, like the LoRA bug in the background."""
    from diffusers import ModelMixin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x, scale=1.0):
            return x + scale * self.proj(x)

    class Scaled(ModelMixin):
        _supports_gradient_checkpointing = True

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.gradient_checkpointing = False

        def forward(self, x, scale=0.5):
            for block in self.blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    args = (x,) if broken else (x, scale)
                    x = self._gradient_checkpointing_func(block, *args)
                else:
                    x = block(x, scale)
            return x

    return Scaled()
