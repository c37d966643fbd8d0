"""Fine-tune a tiny Llama with a LoRA adapter and MemOpt: checkpointing through PEFT, the results verified unchanged.

A transformers ``LlamaForCausalLM`` built from a ``LlamaConfig`` is wrapped by PEFT's ``get_peft_model`` with LoRA on
``q_proj`` and ``v_proj``, and learns generated token sequences (each counting up by its own stride, modulo the vocab),
so nothing is downloaded. ``MemOpt(verify=True)`` switches on the base model's gradient checkpointing when fit starts
(the LoRA weights keep their gradients), measures one batch (without it by a dry run on fake tensors, with it for real),
checks on that batch that the loss and every gradient are unchanged, prints a summary and logs the figures under
``memopt/`` keys in a CSV file. The script then checks that only the LoRA weights changed.

    python examples/finetune_llama_lora.py          # 4 layers, 256 sequences of 128 tokens, 2 epochs
    python examples/finetune_llama_lora.py --quick  # 2 layers, 32 sequences of 64 tokens, 1 epoch
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_memopt import MemOpt

warnings.filterwarnings("ignore", ".*does not have many workers.*")

VOCAB = 64


def sequences(n: int, length: int, seed: int = 0) -> torch.Tensor:
    """``n`` token sequences, counting up from a random start by a random stride (1 to 3), modulo the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % VOCAB


class LoraFineTune(pl.LightningModule):
    """Causal language modelling with a PEFT LoRA adapter on a tiny Llama."""

    def __init__(self, layers: int, samples: int, length: int) -> None:
        super().__init__()
        self.samples, self.length = samples, length
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=length,
        )
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(LlamaForCausalLM(config), lora)  # freezes every weight but LoRA's
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: dict[str, torch.Tensor], batch: list[torch.Tensor], batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())  # here, not in training_step: verify runs the step a second time

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(sequences(self.samples, self.length)), batch_size=8, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model, less data and one epoch (seconds)")
    args = parser.parse_args()

    pl.seed_everything(0)
    module = LoraFineTune(layers=2, samples=32, length=64) if args.quick else LoraFineTune(4, 256, 128)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    memopt = MemOpt(verify=True)  # raises VerificationError if a loss or gradient differs with checkpointing
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1 if args.quick else 2,
        logger=CSVLogger(save_dir="lightning_logs", name="llama_lora"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[memopt],
    )
    trainer.fit(module)

    changed = {name for name, p in module.named_parameters() if not torch.equal(p.detach(), before[name])}
    lora = {name for name in before if "lora_" in name}
    report = memopt.report
    print(f"\ntrain_loss: {module.losses[0]:.3f} on the first batch, {module.losses[-1]:.3f} on the last")
    print(f"logs (train_loss and the memopt/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    print(f"parameters changed: {len(changed)} of {len(before)}; LoRA parameters: {len(lora)}")
    if not changed or not changed <= lora:
        raise SystemExit(f"check failed: parameters other than LoRA's changed: {sorted(changed - lora)[:5]}")
    print("only LoRA parameters were trained: True")
    if report is None or report.saved_fraction is None or report.saved_fraction <= 0:
        raise SystemExit(f"check failed: gradient checkpointing saved nothing ({report})")
    print(f"gradient checkpointing saved {report.saved_fraction:.1%} of the training peak (loss, gradients verified)")


if __name__ == "__main__":
    main()
