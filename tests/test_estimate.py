"""lightning_memopt.estimate and `lightning-memopt estimate`: the figures a real run gives, before it runs, also for
models built on the meta device; nothing of the model changed; clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import MemOpt, PeakMemory, estimate
from tests import zoo
from tests.helpers import LOOP_ARGS, TRAINER_ARGS, Diffusion, Wrapped, fingerprint, heavy, trainer

EXAMPLE = Path(__file__).parent.parent / "examples" / "cli"


def first_batch(model: Wrapped) -> dict[str, torch.Tensor]:
    return next(iter(model.train_dataloader()))


class Quiet(Wrapped):
    """Keeps no copy of the gradients: hooks other than the step are not part of an estimate."""

    def on_after_backward(self) -> None:
        pass


@pytest.mark.parametrize("case", heavy(["unet2d", "bert", "llama", "torch_encoder"], "unet2d", "bert"))
def test_fit_estimate_equals_a_real_later_step(case: str) -> None:
    plain_probe, memopt_probe = PeakMemory(), PeakMemory()
    trainer(plain_probe).fit(Quiet(case))
    trainer(MemOpt(measure=False), memopt_probe).fit(Quiet(case))
    result = estimate(Quiet(case), first_batch(Quiet(case)), "fit")
    assert result.plain.bytes == plain_probe.peaks[1]  # the second step: last step's gradients alive
    assert result.how.startswith("checkpointing") and result.plain.live["gradients"] > 0
    # Llama too: its position ids and the batch's ids stay real in a dry run, so transformers skips the causal mask
    # there as it does in the real step
    assert result.memopt.bytes == memopt_probe.peaks[1] < result.plain.bytes
    # what holds each peak, by kind, as the real step's probe counts it
    assert result.plain.by_kind == plain_probe.held[1] and result.memopt.by_kind == memopt_probe.held[1]


def test_a_mixed_precision_estimate_equals_the_real_trainers_step() -> None:
    """Lightning's MixedPrecision plugin runs autocast without its cache of cast weights; estimate() ran it with the
    cache, which kept a copy of each weight cast alive: 3,113,488 bytes plain against a real 3,085,456 on this encoder,
    and 2,846,232 with MemOpt against 2,547,864."""
    plain_probe, memopt_probe = PeakMemory(), PeakMemory()
    args = dict(precision="bf16-mixed", limit_train_batches=2)
    pl.Trainer(**TRAINER_ARGS, **args, callbacks=[plain_probe]).fit(Quiet("torch_encoder"))
    pl.Trainer(**TRAINER_ARGS, **args, callbacks=[MemOpt(measure=False), memopt_probe]).fit(Quiet("torch_encoder"))
    model = Quiet("torch_encoder")
    result = estimate(model, first_batch(model), "fit", precision="bf16-mixed")
    assert result.plain.bytes == plain_probe.peaks[1]
    assert result.memopt.bytes == memopt_probe.peaks[1] < result.plain.bytes


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_predict_estimate_equals_the_real_run_with_memopts_choice() -> None:
    plain, memopt, probe = PeakMemory(), MemOpt(memory_budget=230_000), PeakMemory()
    trainer(plain, batches=1).predict(Wrapped("latte"))
    trainer(memopt, probe, batches=1).predict(Wrapped("latte"))
    model = Wrapped("latte")
    result = estimate(model, next(iter(model.predict_dataloader())), "predict", memory_budget=230_000)
    assert result.plain.bytes == plain.peaks[0]
    assert result.memopt.bytes == probe.peaks[0] <= 230_000
    assert result.how == f"chunked: {memopt.report.chunk_settings}" and result.fits(230_000)


def test_with_no_technique_of_the_stage_on_the_estimate_is_the_plain_step() -> None:
    """``chunking=False`` at predict leaves no technique on: the figures are the plain step's (it raised before)."""
    model = Wrapped("latte")
    result = estimate(model, next(iter(model.predict_dataloader())), "predict", chunking=False)
    assert result.memopt.bytes == result.plain.bytes is not None and result.how == "nothing to change"


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_a_model_built_on_the_meta_device_gives_the_same_figures() -> None:
    real = Wrapped("unet2d")
    with torch.device("meta"):
        meta = Wrapped("unet2d")
    assert next(meta.parameters()).is_meta
    batch = first_batch(real)
    for stage in ("fit", "predict"):
        a, b = estimate(real, batch, stage), estimate(meta, batch, stage)
        assert (a.plain.bytes, a.memopt.bytes) == (b.plain.bytes, b.memopt.bytes), stage


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_nothing_of_the_model_changes() -> None:
    model = Wrapped("unet2d")
    model.net.encoder_frozen = torch.nn.Linear(2, 2).eval()  # a submodule the user keeps in eval mode
    modes = {n: m.training for n, m in model.named_modules()}
    before, state = fingerprint(model), {k: v.clone() for k, v in model.state_dict().items()}
    estimate(model, first_batch(model), "fit")
    estimate(model, first_batch(model), "predict", chunk_size=2)
    assert fingerprint(model) == before and {n: m.training for n, m in model.named_modules()} == modes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": "train"}, "`stage` must be 'fit', 'predict', 'validate' or 'test', got 'train'"),
        ({"precision": "fp8"}, "`precision` must be one of"),
        ({"chunk_size": 0}, "`chunk_size` must be a positive int or 'auto', got 0"),
        ({"device": "xpu"}, "`device` 'xpu' is not available to this torch: estimate for 'cpu' or 'cuda'"),
    ],
)
def test_bad_arguments_raise_naming_the_value(kwargs: dict, message: str) -> None:
    if kwargs.get("device") == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        pytest.skip("this machine has an XPU")
    model = Wrapped("torch_encoder")
    with pytest.raises(ValueError) as error:
        estimate(model, first_batch(model), **kwargs)
    assert message in str(error.value)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_memopt.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_the_command_reads_a_lightningcli_config() -> None:
    """The example's LightningCLI config names MemOpt with a budget in trainer.callbacks; the command uses it."""
    run = cli("estimate", "--model", "train.SequenceModel", "--config", "config.yaml", cwd=EXAMPLE)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "MemOpt estimate, fit on cpu" in run.stdout and "budget 14.00 MiB" in run.stdout
    assert "MemOpt: checkpointing" in run.stdout
    as_json = cli(
        "estimate", "--model", "train.SequenceModel", "--config", "config.yaml", "--json", "true", cwd=EXAMPLE
    )
    figures = json.loads(as_json.stdout)
    assert figures["memopt"]["peak_bytes"] < figures["plain"]["peak_bytes"] and figures["budget_bytes"] == 14 * 2**20


@pytest.mark.slow
def test_the_command_says_what_is_wrong(tmp_path) -> None:
    run = cli("measure", cwd=tmp_path)
    assert run.returncode == 2 and "unknown command 'measure'" in run.stderr
    run = cli("estimate", "--model", "train.SequenceModel", "--config", "config.yaml", "--stage", "train", cwd=EXAMPLE)
    assert run.returncode != 0 and "train" in run.stderr
    run = cli("estimate", "--model", "train.SequenceModel", "--config", "config.yaml", "--memopt.memory_budget", "2XB",
              cwd=EXAMPLE)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.rstrip().splitlines()[-1].startswith("lightning-memopt estimate: `memory_budget` must be")


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_a_validation_step_is_estimated_as_the_loop_runs_it() -> None:
    """The sampling validation_step of the loop tests: the estimate's figures are those of the real first batch."""
    import lightning.pytorch as pl

    model = Diffusion()
    batch = next(iter(model.val_dataloader()))
    result = estimate(model, batch, stage="validate")
    plain, probe, memopt = PeakMemory(), PeakMemory(), MemOpt()
    pl.Trainer(**LOOP_ARGS, callbacks=[plain]).validate(Diffusion())
    pl.Trainer(**LOOP_ARGS, callbacks=[memopt, probe]).validate(Diffusion())
    assert result.plain.bytes == plain.loop_peaks["validate"][0] and result.plain.where == "VAE decode"
    assert result.memopt.bytes == probe.loop_peaks["validate"][0] and "vae decode sliced" in result.how


def test_a_long_sequence_without_a_cache_is_counted_without_the_causal_mask_the_real_step_skips() -> None:
    """Without a cache, transformers reads the position ids to find packed sequences, but not fake ones, and then
    builds the whole causal mask (tokens x tokens) that the real step skips. A dry run makes positions real up to
    ``POSITIONS`` (they were fake beyond 65,536 tokens): at 131,072 tokens the mask alone would be 16 GiB of booleans,
    counted, and a larger op on real inputs (that mask, where a step does build it) is made fake, never held here."""
    torch.manual_seed(0)
    model = zoo.llama(layers=1, use_cache=False)

    class Long(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.zeros(1, 131_072, dtype=torch.long, device="meta")
    result = estimate(Long(), ids, "fit", checkpointing=False, chunked_loss=False, chunking=False)
    assert result.plain.bytes < 2**30, result
