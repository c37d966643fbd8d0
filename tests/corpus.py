"""A corpus of ordinary steps: LightningModules written as users write them, around tiny models built from configs.

Each reads values out of its tensors somewhere (a diffusers pipeline's default output type hands the images to PIL or
numpy, a seed read from the batch, ``.item()`` in a guard, a boolean mask, the routing of a mixture of experts, a
torchmetrics update), which a dry run on fake tensors cannot compute. ``tests/test_corpus.py`` runs each with and
without ``MemOpt()``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader

from tests import zoo

PROMPTS = ["a red cat", "a dog on grass", "the sea at night", "an old tree"]


def prompts_loader(n: int, batch_size: int) -> DataLoader:
    """``{"prompt": str, "seed": int}`` items: a batch holds a list of prompts and a tensor of seeds."""
    items = [{"prompt": PROMPTS[i % len(PROMPTS)], "seed": 100 + i} for i in range(n)]
    return DataLoader(items, batch_size=batch_size)


class Sampler(pl.LightningModule):
    """A pipeline over the models this LightningModule holds (so MemOpt finds them), sampling in ``predict_step``."""

    pipe: Any

    def setup_pipe(self, pipe: Any) -> None:
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe

    def predict_dataloader(self) -> DataLoader:
        return prompts_loader(4, 2)


class DDPMSampler(Sampler):
    """``DDPMPipeline`` with its default output type (PIL images), seeded from the batch."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DDPMPipeline, DDPMScheduler

        torch.manual_seed(0)
        self.unet = zoo.unet2d()
        self.setup_pipe(DDPMPipeline(unet=self.unet, scheduler=DDPMScheduler(num_train_timesteps=100)))

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        generator = torch.Generator().manual_seed(int(batch["seed"][0]))
        return self.pipe(batch_size=len(batch["seed"]), generator=generator, num_inference_steps=2).images


class StableDiffusionSampler(Sampler):
    """``StableDiffusionPipeline`` from prompts (CLIP tokenizer and text encoder), classifier-free guidance, PIL
    images, one generator per prompt seeded from the batch."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DDIMScheduler, StableDiffusionPipeline

        torch.manual_seed(0)
        self.unet = zoo.unet2d_condition()
        self.vae = zoo.sampler_vae()
        self.text_encoder = zoo.clip_text_encoder()
        pipe = StableDiffusionPipeline(
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=zoo.clip_tokenizer(),
            unet=self.unet,
            scheduler=DDIMScheduler(num_train_timesteps=100),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        self.setup_pipe(pipe)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        generators = [torch.Generator().manual_seed(int(seed)) for seed in batch["seed"]]
        return self.pipe(batch["prompt"], num_inference_steps=2, height=32, width=32, generator=generators).images


class LatteSampler(Sampler):
    """``LattePipeline`` from a prompt (T5 tokenizer and encoder; one prompt a batch, so the pipeline masks the
    caption with ``mask.sum().item()``), videos as PIL frames."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DDIMScheduler, LattePipeline

        torch.manual_seed(0)
        self.transformer = zoo.latte()
        self.vae = zoo.sampler_vae()
        self.text_encoder = zoo.t5_encoder()
        pipe = LattePipeline(
            tokenizer=zoo.t5_tokenizer(),
            text_encoder=self.text_encoder,
            vae=self.vae,
            transformer=self.transformer,
            scheduler=DDIMScheduler(num_train_timesteps=100),
        )
        self.setup_pipe(pipe)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        generator = torch.Generator().manual_seed(int(batch["seed"][0]))
        return self.pipe(
            batch["prompt"][0],
            num_inference_steps=2,
            video_length=3,
            height=32,
            width=32,
            generator=generator,
            clean_caption=False,
        ).frames

    def predict_dataloader(self) -> DataLoader:
        return prompts_loader(2, 1)


class LatteEmbedsSampler(Sampler):
    """``LattePipeline`` from caption embeddings in the batch (no tokenizer, no text encoder), two videos a batch."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DDIMScheduler, LattePipeline

        torch.manual_seed(0)
        self.transformer = zoo.latte()
        self.vae = zoo.sampler_vae()
        pipe = LattePipeline(
            tokenizer=None,
            text_encoder=None,
            vae=self.vae,
            transformer=self.transformer,
            scheduler=DDIMScheduler(num_train_timesteps=100),
        )
        self.setup_pipe(pipe)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        generator = torch.Generator().manual_seed(int(batch["seed"][0]))
        return self.pipe(
            prompt_embeds=batch["embeds"],
            negative_prompt=None,
            negative_prompt_embeds=torch.zeros_like(batch["embeds"]),
            num_inference_steps=2,
            video_length=3,
            height=32,
            width=32,
            generator=generator,
            output_type="np",
        ).frames

    def predict_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        items = [{"embeds": torch.randn(5, 16, generator=g), "seed": 7 + i} for i in range(4)]
        return DataLoader(items, batch_size=2)


class AnimateDiffSampler(Sampler):
    """``AnimateDiffPipeline`` (a UNet2DConditionModel with a motion adapter) from prompt embeddings, PIL frames."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import AnimateDiffPipeline, DDIMScheduler

        torch.manual_seed(0)
        self.unet = zoo.unet2d_condition()
        self.motion_adapter = zoo.motion_adapter()
        self.vae = zoo.sampler_vae()
        pipe = AnimateDiffPipeline(
            vae=self.vae,
            text_encoder=None,
            tokenizer=None,
            unet=self.unet,
            motion_adapter=self.motion_adapter,
            scheduler=DDIMScheduler(num_train_timesteps=100),
        )
        self.unet = pipe.unet  # the UNetMotionModel the pipeline built from the UNet and the adapter
        self.setup_pipe(pipe)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        generator = torch.Generator().manual_seed(int(batch["seed"][0]))
        return self.pipe(
            prompt_embeds=batch["embeds"],
            negative_prompt_embeds=torch.zeros_like(batch["embeds"]),
            num_frames=2,
            num_inference_steps=2,
            height=32,
            width=32,
            generator=generator,
        ).frames

    def predict_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        items = [{"embeds": torch.randn(5, 16, generator=g), "seed": 7 + i} for i in range(4)]
        return DataLoader(items, batch_size=2)


# fit: language models with ordinary steps --------------------------------------------------------------------------


MODELS = {"llama": zoo.llama, "mixtral": zoo.mixtral, "qwen2_moe": zoo.qwen2_moe}


class LM(pl.LightningModule):
    """Next-token prediction on random ids; the subclasses change only the step, as users do."""

    def __init__(self, model: str = "llama", batches: int = 2, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MODELS[model]()
        self.batches, self.lr = batches, lr

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["ids"]
        loss = F.cross_entropy(self.logits(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        items = [{"ids": torch.randint(0, 128, (16,), generator=g)} for _ in range(2 * self.batches)]
        return DataLoader(items, batch_size=2)


class ItemGuard(LM):
    """``.item()`` in the step: a divergence guard."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:
            raise RuntimeError(f"the loss diverged at batch {batch_idx}")
        return loss


class MaskedLoss(LM):
    """A loss over the positions a boolean mask keeps (every id divisible by 5 is padding): its size depends on the
    data."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["ids"]
        logits, targets = self.logits(ids)[:, :-1], ids[:, 1:]
        valid = targets % 5 != 0
        loss = F.cross_entropy(logits[valid], targets[valid])
        self.log_dict({"train_loss": loss, "kept": valid.float().mean()})
        return loss


class WithAccuracy(LM):
    """A torchmetrics ``Accuracy`` updated in the step and logged, next to the loss."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from torchmetrics.classification import MulticlassAccuracy

        self.accuracy = MulticlassAccuracy(num_classes=128)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["ids"]
        logits = self.logits(ids)[:, :-1].flatten(0, 1)
        loss = F.cross_entropy(logits, ids[:, 1:].flatten())
        self.accuracy(logits.argmax(-1), ids[:, 1:].flatten())
        self.log_dict({"train_loss": loss, "train_acc": self.accuracy})
        return loss


class LoggedAsTheDocsShow(LM):
    """Logging as Lightning's docs show it: keywords on step and epoch, a torchmetrics metric in training and in
    validation, ``log_dict`` with keywords."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        self.train_acc, self.val_acc = MulticlassAccuracy(num_classes=128), MulticlassAccuracy(num_classes=128)
        self.perplexity = MeanMetric()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["ids"]
        logits = self.logits(ids)[:, :-1].flatten(0, 1)
        loss = F.cross_entropy(logits, ids[:, 1:].flatten())
        self.train_acc(logits.argmax(-1), ids[:, 1:].flatten())
        self.perplexity.update(loss.detach().exp())
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=len(ids))
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log_dict({"perplexity": self.perplexity}, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["ids"]
        logits = self.logits(ids)[:, :-1].flatten(0, 1)
        self.val_acc.update(logits.argmax(-1), ids[:, 1:].flatten())
        self.log("val_acc", self.val_acc, on_epoch=True, prog_bar=True)
        self.log("val_loss", F.cross_entropy(logits, ids[:, 1:].flatten()), reduce_fx="max", batch_size=len(ids))

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


class TwoOptimizers(LM):
    """Manual optimization: the language model and a separate value head, each with its own optimizer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.head = nn.Linear(32, 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt_lm, opt_head = self.optimizers()
        ids = batch["ids"]
        out = self.model(input_ids=ids, output_hidden_states=True)
        lm_loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt_lm.zero_grad()
        self.manual_backward(lm_loss)
        opt_lm.step()
        value = self.head(out.hidden_states[-1].detach()).squeeze(-1)
        head_loss = F.mse_loss(value, ids.float() / 128)
        opt_head.zero_grad()
        self.manual_backward(head_loss)
        opt_head.step()
        self.log_dict({"lm_loss": lm_loss, "head_loss": head_loss})

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr), torch.optim.Adam(self.head.parameters(), lr=1e-3)


# a logger that keeps what it is sent -------------------------------------------------------------------------------


class MemoryLogger(Logger):
    """Keeps every metrics dict it is sent, in order, and the hyperparameters."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.hparams: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.hparams.update(params if isinstance(params, dict) else vars(params))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step or 0, dict(metrics)))

    def values(self, prefix: str = "") -> dict[str, list[float]]:
        """Each key's logged values in order; with ``prefix``, only the keys that start with it."""
        result: dict[str, list[float]] = {}
        for _, metrics in self.metrics:
            for key, value in metrics.items():
                if key.startswith(prefix) and key != "epoch":
                    result.setdefault(key, []).append(float(value))
        return result

    def user_values(self) -> dict[str, list[float]]:
        """What the step logged: every key but MemOpt's."""
        return {k: v for k, v in self.values().items() if not k.startswith("memopt/")}
