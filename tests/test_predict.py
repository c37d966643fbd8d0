"""MemOpt at predict: feed-forward chunking lowers the peak, outputs stay equal, mixed block lengths never crash."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt, PeakMemory
from lightning_memopt.compat import FakeTensor
from tests import zoo
from tests.helpers import PREDICT_CASES, Wrapped, fingerprint, heavy, trainer


def run_predict(case: str, *callbacks) -> tuple[Wrapped, PeakMemory, list[torch.Tensor]]:
    model = Wrapped(case)
    probe = PeakMemory()
    outputs = trainer(*callbacks, probe).predict(model)
    return model, probe, outputs


@functools.cache
def plain(case: str) -> tuple[list[torch.Tensor], PeakMemory]:
    """The outputs and exact peaks of the case run without MemOpt: computed once, read by every test that compares."""
    _, probe, outputs = run_predict(case)
    return outputs, probe


@pytest.mark.parametrize("case", heavy(PREDICT_CASES, "svd_unet"))
def test_predict_lowers_peak_and_keeps_outputs(case: str) -> None:
    plain_out, plain_probe = plain(case)
    model = Wrapped(case)
    before = fingerprint(model.net)
    probe = PeakMemory()
    memopt = MemOpt(chunk_size=2)
    outputs = trainer(memopt, probe).predict(model)

    assert memopt.applied and memopt.applied[0].technique == "chunking"
    assert probe.peak < plain_probe.peak
    assert len(outputs) == len(plain_out) == 2
    for a, b in zip(outputs, plain_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fingerprint(model.net) == before


class FeedForwardInputs(Wrapped):
    """The Latte case, keeping the shape of every input its blocks' feed-forward modules get in the predict steps:
    one whole input where a block runs unchunked, one slice per call where it runs chunked (MemOpt's dry runs, on
    fake tensors, are left out; its measurement runs outside the step)."""

    def __init__(self) -> None:
        super().__init__("latte")
        self.shapes: dict[str, list[tuple[int, ...]]] = {"transformer_blocks": [], "temporal_transformer_blocks": []}
        self.stepping = False
        for name, block in self.net.named_modules():
            if hasattr(block, "set_chunk_feed_forward"):
                block.ff.register_forward_pre_hook(functools.partial(self._record, name.split(".")[0]))

    def _record(self, stack: str, module, args) -> None:
        if self.stepping and not isinstance(args[0], FakeTensor):
            self.shapes[stack].append(tuple(args[0].shape))

    def predict_step(self, batch, batch_idx):
        self.stepping = True
        try:
            return super().predict_step(batch, batch_idx)
        finally:
            self.stepping = False


#: Per chunk size, the slice each stack's feed-forward runs on: the largest divisor of the block's own length (16
#: tokens, 3 frames) not above it, the whole length where it fits (64 fits both: nothing is chunked).
SLICES = {1: (1, 1), 2: (2, 1), 3: (2, 3), 5: (4, 3), 7: (4, 3), 64: (16, 3)}


@pytest.mark.parametrize("chunk_size", list(SLICES))
def test_any_chunk_size_runs_on_mixed_block_lengths(chunk_size: int) -> None:
    """Latte's spatial blocks chunk 16 tokens and its temporal blocks 3 frames: no size may crash either, and each
    block runs on slices of its own valid length."""
    model = FeedForwardInputs()
    chunked = trainer(MemOpt(chunk_size=chunk_size)).predict(model)
    for a, b in zip(chunked, plain("latte")[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for (stack, shapes), length, size in zip(model.shapes.items(), (16, 3), SLICES[chunk_size], strict=True):
        assert {shape[1] for shape in shapes} == {size}, (stack, shapes)
        assert len(shapes) == 2 * len(model.net.transformer_blocks) * length // size, (stack, shapes)  # 2 batches


def test_each_block_gets_a_valid_divisor_of_its_own_length() -> None:
    model = Wrapped("latte")
    seen: dict[str, set[int]] = {}

    def record(block, args, kwargs, output):
        seen.setdefault(block.name, set()).add(block._chunk_size)

    for name, block in model.net.named_modules():
        if hasattr(block, "set_chunk_feed_forward"):
            block.name = name.split(".")[0]
            block.register_forward_hook(record, with_kwargs=True)
    trainer(MemOpt(chunk_size=4, measure=False)).predict(model)  # the measurement's side step runs unchunked
    assert seen == {"transformer_blocks": {4}, "temporal_transformer_blocks": {None}}  # 16 tokens; 3 frames fit in 4
    seen.clear()
    trainer(MemOpt(chunk_size=2, measure=False)).predict(model)
    assert seen == {"transformer_blocks": {2}, "temporal_transformer_blocks": {1}}


def test_chunk_dim_zero_chunks_the_batch() -> None:
    model = FeedForwardInputs()
    chunked = trainer(MemOpt(chunk_size=1, chunk_dim=0)).predict(model)
    for a, b in zip(chunked, plain("latte")[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # one sample at a time: 2 videos x 3 frames in a spatial block, 2 videos x 16 tokens in a temporal one
    for (stack, shapes), rows in zip(model.shapes.items(), (2 * 3, 2 * 16), strict=True):
        assert shapes and {shape[0] for shape in shapes} == {1}, (stack, shapes)
        assert len(shapes) == 2 * len(model.net.transformer_blocks) * rows, (stack, len(shapes))  # 2 batches


def test_generic_chunking_of_llama_mlps() -> None:
    plain_out, plain_probe = plain("llama")
    memopt = MemOpt(chunk_size=4)
    _, probe, chunked = run_predict("llama", memopt)
    assert memopt.applied[0].method == "generic chunking of LlamaMLP"
    assert probe.peak < plain_probe.peak
    for a, b in zip(chunked, plain_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    heavy(["unet2d_condition_lora", "dit", "sd3", "svd_unet", "peft_llama"], "unet2d_condition_lora", "svd_unet"),
)
def test_chunking_other_families_keeps_outputs(case: str) -> None:
    """A chunk size of 3 divides none of these lengths exactly; each block falls back to a divisor of its own."""
    model = Wrapped(case)
    before = fingerprint(model.net)
    memopt = MemOpt(chunk_size=3)
    chunked = trainer(memopt).predict(model)
    assert memopt.applied
    for a, b in zip(chunked, plain(case)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fingerprint(model.net) == before


@pytest.mark.parametrize("case", ["flux", "wan"])
def test_generic_chunking_of_diffusers_feed_forward_without_a_switch(case: str) -> None:
    """Flux and Wan blocks have no set_chunk_feed_forward; their FeedForward modules are chunked generically.

    Flux's single-stream blocks compute their MLP inline with attention, so there the peak (held by those blocks in
    this tiny model) does not drop; Wan's does.
    """
    plain_out, plain_probe = plain(case)
    model = Wrapped(case)
    before = fingerprint(model.net)
    probe = PeakMemory()
    memopt = MemOpt(chunk_size=4)
    chunked = trainer(memopt, probe).predict(model)
    assert memopt.applied[0].method == "generic chunking of FeedForward"
    assert probe.peak < plain_probe.peak if case == "wan" else probe.peak <= plain_probe.peak
    for a, b in zip(chunked, plain_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fingerprint(model.net) == before


class OtherLM(Wrapped):
    """The llama case's data around another transformers language model."""

    def __init__(self, factory) -> None:
        super().__init__("llama")
        torch.manual_seed(0)
        self.model = factory()

    def predict_step(self, batch, batch_idx):
        if hasattr(self.model, "decoder"):  # T5
            return self.model(input_ids=batch["ids"], decoder_input_ids=batch["ids"][:, :5]).logits
        return self.model(input_ids=batch["ids"]).logits


@functools.cache
def plain_lm(factory) -> list[torch.Tensor]:
    return trainer(batches=2).predict(OtherLM(factory))


@pytest.mark.parametrize("factory", [zoo.gpt2, zoo.bloom], ids=["gpt2", "bloom"])
@pytest.mark.parametrize("chunk_size", [2, "auto"])
def test_generic_chunking_of_decoders_whose_mlp_views_its_input_or_takes_a_residual(factory, chunk_size) -> None:
    """GPT-2's Conv1D views its input (a slice along the sequence is not contiguous); BLOOM's MLP adds a residual it
    takes as a second argument, which must be cut with the input."""

    model = OtherLM(factory)
    before = fingerprint(model.net)
    chunked = trainer(MemOpt(chunk_size=chunk_size), batches=2).predict(model)
    for a, b in zip(chunked, plain_lm(factory), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fingerprint(model.net) == before


@pytest.mark.parametrize(("factory", "found"), [(zoo.t5, "T5LayerFF"), (zoo.mixtral, "MixtralSparseMoeBlock")])
def test_feed_forward_modules_are_found_by_what_they_are_named(factory, found) -> None:
    """T5's feed-forward layer and the mixture-of-experts block of Mixtral are token-wise: chunked, outputs kept."""

    memopt = MemOpt(chunk_size=4)
    chunked = trainer(memopt, batches=2).predict(OtherLM(factory))
    assert memopt.applied[0].method == f"generic chunking of {found}"
    for a, b in zip(chunked, plain_lm(factory), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_model_with_nothing_to_chunk_still_logs_its_peak(tmp_path) -> None:
    """A UNet2DModel has no feed-forward layer and no VAE: nothing changes, and the figures are still known."""
    plain, memopt = PeakMemory(), MemOpt()
    trainer(plain, batches=1).predict(Wrapped("unet2d"))
    trainer_ = trainer(memopt, batches=1)
    trainer_.loggers = [CSVLogger(tmp_path)]
    with pytest.warns(UserWarning, match="no blocks MemOpt can use for chunking"):
        outputs = trainer_.predict(Wrapped("unet2d"))
    report = memopt.report
    assert outputs and not report.applied
    assert report.baseline_peak_bytes == report.peak_bytes == plain.peaks[0]
    (path,) = tmp_path.glob("**/metrics.csv")
    assert "memopt/peak_bytes" in path.read_text() and "memopt/baseline_peak_bytes" in path.read_text()


class Encoder(pl.LightningModule):
    """A plain ``nn.TransformerEncoder`` whose inference runs torch's fused fast path (batch first) or not, with a
    padding mask."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 2, 512, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.batch_first = batch_first

    def predict_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        items = [(torch.randn(4, 16, 32, generator=g), torch.arange(16).expand(4, 16) >= 12 + i) for i in range(2)]
        return DataLoader(items, batch_size=None)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, padding = batch
        return self.encoder(x if self.batch_first else x.transpose(0, 1), src_key_padding_mask=padding)


def test_a_plain_transformer_encoder_is_chunked_by_batch_with_the_same_outputs() -> None:
    plain_probe, probe, memopt = PeakMemory(), PeakMemory(), MemOpt()
    expected = trainer(plain_probe).predict(Encoder(batch_first=False))
    model = Encoder(batch_first=False)
    before = fingerprint(model.encoder)
    outputs = trainer(memopt, probe).predict(model)

    assert [(a.technique, a.method, a.blocks) for a in memopt.applied] == [
        ("chunking", "generic chunking of TransformerEncoderLayer by batch", 3)
    ]
    assert probe.peak < 0.8 * plain_probe.peak
    for a, b in zip(outputs, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fingerprint(model.encoder) == before


def test_a_batch_first_transformer_encoder_runs_torch_fused_kernel_whole_and_says_so() -> None:
    memopt = MemOpt()
    expected = trainer().predict(Encoder(batch_first=True))
    with pytest.warns(UserWarning, match=r"3 TransformerEncoderLayer \(batch_first=True\) left whole: .* fused kernel"):
        outputs = trainer(memopt).predict(Encoder(batch_first=True))
    assert not memopt.applied
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
