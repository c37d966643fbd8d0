"""Models from the diffusers and transformers test suites that once broke MemOpt, built from small configs of our own:
each trains with ``MemOpt(verify=True)`` or is skipped with one warning naming it, crashes nothing, changes no result
and leaves no state behind."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import MemOpt
from tests.helpers import TRAINER_ARGS, fingerprint

pytestmark = pytest.mark.slow  # video autoencoders: seconds each; run by CI with `python -m pytest -m slow`

#: Small configs: the class, its arguments, and the shape of one sample (channels, [frames,] height, width).
AUTOENCODERS = {
    "AutoencoderKLCosmos": (  # a ModuleList holding None broke applying, and left the checkpoint function set
        dict(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            encoder_block_out_channels=(8, 8, 8, 8),
            decode_block_out_channels=(8, 8, 8, 8),
            attention_resolutions=(8,),
            resolution=64,
            num_layers=2,
            patch_size=4,
            patch_type="haar",
            spatial_compression_ratio=4,
            temporal_compression_ratio=4,
        ),
        (3, 9, 32, 32),
    ),
    "AutoencoderKLMochi": (  # the same
        dict(
            in_channels=15,
            out_channels=3,
            latent_channels=4,
            encoder_block_out_channels=(32, 32, 32, 32),
            decoder_block_out_channels=(32, 32, 32, 32),
            layers_per_block=(1, 1, 1, 1, 1),
        ),
        (3, 7, 16, 16),
    ),
    "AutoencoderKLMagvit": (  # its causal convolutions keep the last frames on the module for their next call
        dict(
            in_channels=3,
            latent_channels=4,
            out_channels=3,
            block_out_channels=[8, 8, 8, 8],
            down_block_types=["SpatialDownBlock3D"] + ["SpatialTemporalDownBlock3D"] * 3,
            up_block_types=["SpatialUpBlock3D"] + ["SpatialTemporalUpBlock3D"] * 3,
            layers_per_block=1,
            norm_num_groups=8,
            spatial_group_norm=True,
        ),
        (3, 9, 16, 16),
    ),
    "AutoencoderKLKVAEVideo": (  # a cache dict passed from block to block is filled by the first run
        dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, in_channels=3, out_ch=3, z_channels=4, temporal_compress_times=2),
        (3, 3, 16, 16),
    ),
    "AutoencoderTiny": (  # its encoder's checkpointed path skips the scaling of the input
        dict(
            encoder_block_out_channels=(32, 32),
            decoder_block_out_channels=(32, 32),
            num_encoder_blocks=(1, 2),
            num_decoder_blocks=(2, 1),
        ),
        (3, 32, 32),
    ),
}


class Autoencoder(pl.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        import diffusers

        config, self.shape = AUTOENCODERS[name]
        torch.manual_seed(0)
        self.vae = getattr(diffusers, name)(**config)

    def training_step(self, batch, batch_idx):
        out = self.vae(batch).sample
        return (out - batch[:, : out.shape[1]]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, *self.shape, generator=torch.Generator().manual_seed(1)), 2)


def train_with_verify(make: Callable[[], pl.LightningModule], attr: str) -> tuple[MemOpt, list[str]]:
    """Two steps plain and two with ``MemOpt(verify=True)``: the weights must be equal and the model ``attr`` as it
    was. Returns the callback and MemOpt's warnings."""
    plain, model = make(), make()
    before = fingerprint(getattr(model, attr))
    pl.Trainer(**TRAINER_ARGS, limit_train_batches=2).fit(plain)
    memopt = MemOpt(verify=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**TRAINER_ARGS, limit_train_batches=2, callbacks=[memopt]).fit(model)
    assert fingerprint(getattr(model, attr)) == before
    for (key, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=key)
    return memopt, [str(w.message) for w in caught if "MemOpt" in str(w.message)]


@pytest.mark.parametrize("name", sorted(AUTOENCODERS))
def test_autoencoders_train_with_verify_and_are_restored(name: str) -> None:
    memopt, ours = train_with_verify(lambda: Autoencoder(name), "vae")
    if name == "AutoencoderTiny":  # checkpointed where it computes the same, and the rest named in one warning
        assert len(ours) == 1 and "`encoder` (EncoderTiny) is not checkpointed" in ours[0]
    else:
        assert not ours and memopt.applied and memopt.report.peak_bytes < memopt.report.baseline_peak_bytes


class AnyFlow(pl.LightningModule):
    """A causal video transformer whose attention is flex_attention: a higher-order operator, compiled when eager."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import AnyFlowFARTransformer3DModel

        torch.manual_seed(0)
        self.transformer = AnyFlowFARTransformer3DModel(
            patch_size=(1, 2, 2),
            compressed_patch_size=(1, 4, 4),
            full_chunk_limit=3,
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            rope_max_seq_len=32,
            gate_value=0.25,
            deltatime_type="r",
        )

    def predict_step(self, batch, batch_idx):
        return self.transformer(
            hidden_states=batch["x"],
            timestep=batch["t"],
            r_timestep=batch["t"] / 2,
            encoder_hidden_states=batch["c"],
            chunk_partition=[2, 2],
        ).sample

    def predict_dataloader(self):
        g = torch.Generator().manual_seed(0)
        item = lambda: {  # noqa: E731
            "x": torch.randn(4, 4, 16, 16, generator=g),
            "t": torch.full((4,), 500.0),
            "c": torch.randn(12, 16, generator=g),
        }
        return torch.utils.data.DataLoader([item(), item()], batch_size=1)


@pytest.mark.parametrize("memopt", [dict(chunk_size=2), dict(), dict(measure=False)])
def test_flex_attention_runs_under_exact_accounting_and_dry_runs(memopt: dict) -> None:
    """flex_attention's eager path compiles it, which torch refuses under a dispatch mode, and then the process could
    not run the model at all. Under MemOpt's probe and dry runs it runs its operator directly, counted op by op."""
    plain = pl.Trainer(**TRAINER_ARGS).predict(AnyFlow())
    callback = MemOpt(**memopt)
    outputs = pl.Trainer(**TRAINER_ARGS, callbacks=[callback]).predict(AnyFlow())
    for a, b in zip(outputs, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if callback.measure:
        assert callback.report.baseline_peak_bytes is not None
    assert pl.Trainer(**TRAINER_ARGS).predict(AnyFlow())  # the process can still run it


class WanAnimate2(pl.LightningModule):
    """Wan-Animate-2's reference pass: its blocks take the KV cache as a keyword argument, which diffusers' own
    checkpoint function rejected (`unexpected keyword argument 'kv_cache'`)."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import WanAnimate2Transformer3DModel

        torch.manual_seed(0)
        self.transformer = WanAnimate2Transformer3DModel(
            patch_size=(1, 2, 2), text_len=8, in_dim=16 + 20, dim=32, ffn_dim=64, freq_dim=16, text_dim=16,
            out_dim=16, num_heads=2, num_layers=2, use_img_emb=True,
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

        x = batch["x"]
        out = self.transformer(
            hidden_states=list(x),
            timestep=torch.tensor([1.0]),
            encoder_hidden_states=list(batch["text"]),
            condition_latents=list(batch["cond"]),
            encoder_hidden_states_image=batch["image"][:1],  # one reference image for the segment
            kv_cache=WanAnimate2KVCache(2),
            kv_cache_mode="extract",
            seq_len=2 * 2 * 2,  # latent frames x patches per frame
            offset_grid_sizes=torch.tensor([[2, 2, 2]]),
            return_dict=False,
        )[0]
        return (torch.stack(out) - x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        item = lambda: {  # noqa: E731
            "x": torch.randn(16, 2, 4, 4, generator=g),
            "cond": torch.randn(20, 2, 4, 4, generator=g),
            "text": torch.randn(4, 16, generator=g),
            "image": torch.randn(4, 1280, generator=g),  # diffusers fixes the CLIP width at 1280
        }
        return torch.utils.data.DataLoader([item() for _ in range(4)], batch_size=2)


def test_wan_animate_2_trains_with_verify_and_is_restored() -> None:
    memopt, ours = train_with_verify(WanAnimate2, "transformer")
    blocks = [(a.technique, a.blocks) for a in memopt.applied if a.technique != "free_gradients"]
    assert not ours and blocks == [("checkpointing", 2)]
