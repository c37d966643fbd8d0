"""The techniques that change results (issue 44): one contract for each, a warning that gives the difference it
measured, the difference logged as ``memopt/<technique>_difference``, and a line of the printed summary; and
bitsandbytes, imported only where one of them quantizes something, without its import-time noise."""

from __future__ import annotations

import csv
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_memopt import MemOpt
from lightning_memopt.techniques import lossy
from tests.helpers import TRAINER_ARGS
from tests.test_stepping import Layers

ROOT = Path(__file__).resolve().parent.parent


class Predicts(Layers):
    """Six 256x256 layers: trained with AdamW (their moments kept in 8 bits), and run at predict (their weights)."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.blocks(batch)

    def predict_dataloader(self) -> Any:
        return self.train_dataloader()


#: Each technique that changes results: its options, the stage it is run in, and what its warning says is kept.
LOSSY = {
    "optimizer_state_8bit": ({"optimizer_state_8bit": True}, "fit", r"Adam's moments are kept in 8 bits"),
    "weights_8bit": ({"weights_8bit": True, "chunking": False}, "predict", r"the weights of 6 layers are kept in 8"),
}


@pytest.mark.parametrize("technique", list(LOSSY))
def test_each_lossy_technique_warns_logs_and_summarizes_its_difference(technique: str, tmp_path: Path) -> None:
    """The 8-bit state said its difference in the report alone (``report.optimizer_state_8bit_difference``): no
    warning, no logged key, no summary line; the 8-bit weights had no summary line."""
    options, stage, kept = LOSSY[technique]
    memopt = MemOpt(lossy=True, **options)
    trainer = pl.Trainer(
        **{**TRAINER_ARGS, "logger": CSVLogger(tmp_path, name="run")},
        limit_train_batches=3,
        limit_predict_batches=2,
        callbacks=[memopt],
    )
    pattern = (
        rf"{kept}\b.*, which changes results: the largest difference of .* is (?P<value>\S+) of .* "
        rf"\(logged as memopt/{technique}_difference\)"
    )
    with pytest.warns(UserWarning, match=pattern) as caught:
        trainer.fit(Predicts()) if stage == "fit" else trainer.predict(Predicts())
    said = [w for w in caught if f"memopt/{technique}_difference" in str(w.message)]
    assert len(said) == 1, "said once"
    difference = getattr(memopt.report, f"{technique}_difference")
    assert difference is not None and 0 < difference < 0.02
    assert f" is {difference:.2g} of " in str(said[0].message)
    # logged, as the figures of the measured batch are
    with open(next(tmp_path.glob("run/*/metrics.csv"))) as file:
        logged = [row[f"memopt/{technique}_difference"] for row in csv.DictReader(file)]
    assert float(next(v for v in logged if v)) == pytest.approx(difference)
    # a line of its section in the summary, below the technique's row
    rows = memopt.report.rows()
    line = f"changes results: largest difference {difference:.2g} of"
    index = next(i for i, row in enumerate(rows) if row[2].startswith(line))
    assert rows[index][2].endswith(f"({technique}_difference)")
    assert technique in [row[1] for row in rows[:index]]
    assert line in str(memopt.report)


NO_8_BITS = """
import sys

import lightning_memopt
from lightning_memopt import MemOpt, estimate

assert "bitsandbytes" not in sys.modules, "imported by import lightning_memopt"
MemOpt(), MemOpt(memory_budget="1GiB", lossy=True), MemOpt(optimizer_state_8bit=True, weights_8bit=True, lossy=True)
assert "bitsandbytes" not in sys.modules, "imported by MemOpt()"

import lightning.pytorch as pl
import torch


class Layers(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])

    def training_step(self, batch, batch_idx):
        return self.blocks(batch).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        return self.blocks(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 256), batch_size=2)

    predict_dataloader = train_dataloader


def trainer(memopt):
    args = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(accelerator="cpu", max_epochs=1, callbacks=[memopt], **args)


# a budget met without 8 bits: the 8-bit state and weights are set up, never in force
for options in ({}, {"memory_budget": "1GiB"}, {"memory_budget": "1GiB", "lossy": True}):
    trainer(MemOpt(**options)).fit(Layers())
    trainer(MemOpt(**options)).predict(Layers())
    assert "bitsandbytes" not in sys.modules, f"imported by a fit or predict with {options}"
# dry runs count the 8-bit ops without them
result = estimate(Layers(), torch.randn(2, 256), "fit", optimizer_state_8bit=True, lossy=True)
assert result.saved_by["optimizer_state_8bit"] > 0
assert "bitsandbytes" not in sys.modules, "imported by estimate()"
print("bitsandbytes left out")
"""


def run_python(script: str, tmp_path: Path) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.slow  # a fresh Python running a fit: 6 s
def test_bitsandbytes_is_left_out_of_a_run_that_keeps_nothing_in_8_bits(tmp_path: Path) -> None:
    """It was imported, with its kernels' noise, by every fit under a budget (the 8-bit state made its maps when it
    was set up) and by ``estimate()`` with the 8-bit state (the dry run ran bitsandbytes' fake-tensor rules)."""
    said = run_python(NO_8_BITS, tmp_path)
    assert "bitsandbytes left out" in said
    assert "bitsandbytes" not in said.replace("bitsandbytes left out", "") and "kernels" not in said


QUANTIZES = """
import sys

import torch

from lightning_memopt.techniques.lossy import dequantize, quantize

value = torch.randn(4096)
codes, scale = quantize(value, signed=True)
assert (dequantize(codes, scale, True, torch.float32) - value).abs().max() < 0.05 * value.abs().max()
assert "bitsandbytes" in sys.modules
print("quantized")
"""


@pytest.mark.slow  # a fresh Python importing bitsandbytes: 6 s
def test_bitsandbytes_says_nothing_of_its_kernels_when_it_is_imported(tmp_path: Path) -> None:
    """``import bitsandbytes`` logged 'Failed to load CPU gemm_4bit_forward from kernels-community: ... could not
    verify publisher trust status' (with the ``kernels`` package, on a CPU with AVX-512 BF16), and offline the
    ``kernels`` package that it skipped the trust check."""
    pytest.importorskip("bitsandbytes")
    said = run_python(QUANTIZES, tmp_path)
    assert "quantized" in said
    assert "gemm_4bit" not in said and "kernels" not in said, said


@pytest.fixture
def fake_bitsandbytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An importable ``bitsandbytes`` of our own, in place of any imported one (put back after)."""
    for name in [n for n in sys.modules if n == "bitsandbytes" or n.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "bitsandbytes").mkdir()
    yield tmp_path / "bitsandbytes" / "__init__.py"
    if str(getattr(sys.modules.get("bitsandbytes"), "__file__", "")).startswith(str(tmp_path)):
        del sys.modules["bitsandbytes"]  # ours goes; monkeypatch puts back the one imported before


NOISY = """
import logging
import sys
import warnings

print("Failed to load CPU gemm_4bit_forward from kernels-community: printed")
print("something else, printed", file=sys.stderr)
cpu = logging.getLogger("bitsandbytes.backends.cpu.ops")
cpu.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s", "could not verify publisher trust")
logging.getLogger("kernels._internals.hf_hub").warning("Skipping publisher trust check")
logging.getLogger("bitsandbytes.cextension").warning("something else, logged")
warnings.warn("`torch.jit.script_method` is deprecated. Please switch to `torch.compile`", DeprecationWarning)
warnings.warn("something else, warned", UserWarning)
"""


def test_its_known_noise_is_dropped_and_the_rest_said(
    fake_bitsandbytes: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    fake_bitsandbytes.write_text(NOISY)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        module = lossy.bitsandbytes()
    assert module.__file__ == str(fake_bitsandbytes) and sys.modules["bitsandbytes"] is module
    out, err = capsys.readouterr()
    assert "gemm_4bit" not in out + err and "something else, printed" in err
    assert [r.getMessage() for r in caplog.records] == ["something else, logged"]
    assert [str(w.message) for w in caught] == ["something else, warned"]
    assert lossy.bitsandbytes() is module  # imported once
    # the filters are gone once it is imported
    assert not logging.getLogger("bitsandbytes.backends.cpu.ops").filters
    assert logging.getLogger("kernels").level == logging.NOTSET


def test_an_error_importing_it_is_raised_with_what_it_printed(
    fake_bitsandbytes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bitsandbytes.write_text(NOISY + "\nraise RuntimeError('no library for this machine')\n")
    with pytest.raises(RuntimeError, match="no library for this machine"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lossy.bitsandbytes()
    out, err = capsys.readouterr()
    assert "gemm_4bit_forward from kernels-community: printed" in out and "something else, printed" in err
    assert "bitsandbytes" not in sys.modules
