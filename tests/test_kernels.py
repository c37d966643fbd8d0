"""An estimate for a GPU on a machine without one counts attention as the GPU's kernels keep it, not the CPU's.

The CPU runs one flash kernel for every dtype, head dimension and mask; a GPU picks flash, memory-efficient or math
attention, which keep different tensors for the backward pass (lightning_memopt/kernels.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt import estimate
from lightning_memopt.kernels import attention, attention_backend, cuda_kernels


class Attention(pl.LightningModule):
    """One self-attention layer: 4 heads over a width of ``width``, through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float32, causal_mask: bool = False) -> None:
        super().__init__()
        self.causal_mask = causal_mask
        self.qkv = nn.Linear(width, 3 * width, dtype=dtype)
        self.out = nn.Linear(width, width, dtype=dtype)

    def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        b, n, width = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, width // 4).permute(2, 0, 3, 1, 4)
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril() if self.causal_mask else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, n, width)).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def q(head: int, dtype: torch.dtype = torch.float32, length: int = 16) -> torch.Tensor:
    return torch.empty(1, 2, length, head, dtype=dtype)


@pytest.mark.parametrize(
    "head, dtype, mask, causal, backend",
    [
        (64, torch.bfloat16, None, False, "flash"),
        (64, torch.float16, None, True, "flash"),
        (40, torch.bfloat16, None, False, "flash"),  # padded to 48 first, but flash
        (320, torch.bfloat16, None, False, "efficient"),  # over flash's 256
        (64, torch.bfloat16, torch.ones(16, 16, dtype=torch.bool), False, "efficient"),  # flash takes no mask
        (64, torch.float32, None, False, "efficient"),  # flash takes half precision only
        (12, torch.float32, None, False, "efficient"),  # a multiple of 4 in float32
        (12, torch.float16, torch.ones(16, 16, dtype=torch.bool), False, "math"),  # not a multiple of 8 in half
        (6, torch.float32, None, False, "math"),
        (64, torch.float64, None, False, "math"),
    ],
)
def test_a_gpu_picks_its_attention_backend_by_dtype_head_dimension_and_mask(head, dtype, mask, causal, backend):
    assert attention_backend(q(head, dtype), q(head, dtype), q(head, dtype), mask, causal) == backend


def test_a_causal_mask_over_unequal_lengths_leaves_flash():
    query, key = q(64, torch.bfloat16, 8), q(64, torch.bfloat16, 16)
    assert attention_backend(query, key, key, None, True) == "efficient"
    assert attention_backend(query, key, key, None, False) == "flash"


def test_the_math_kernel_gives_what_the_cpu_gives():
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 4, 10, 6) for _ in range(3))
    mask = torch.rand(10, 10) > 0.3
    mask.fill_diagonal_(True)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    torch.testing.assert_close(attention(query, key, value, mask, backend="math"), expected)


def test_float32_attention_keeps_the_memory_efficient_kernels_log_sum_exp_rounded_up_to_32_queries():
    # 100 queries: the GPU's log-sum-exp holds 128 per head (4 bytes each); the CPU's flash kernel holds 100.
    batch = torch.randn(2, 100, 64)
    cpu = estimate(Attention(64), batch, device="cpu")
    gpu = estimate(Attention(64), batch, device="cuda")
    extra = gpu.plain.bytes - cpu.plain.bytes
    assert 2 * 4 * (128 - 100) * 4 <= extra <= 2 * 4 * (128 - 100) * 4 + 64, (cpu.plain.bytes, gpu.plain.bytes)
    assert "attention counted as a GPU of compute capability 8.0+ runs it: memory-efficient 1 call" in gpu.notes
    assert not any("attention counted" in n for n in cpu.notes)


def test_a_boolean_mask_becomes_a_float_bias_padded_to_rows_of_16():
    batch = torch.randn(2, 100, 64)
    cpu = estimate(Attention(64, causal_mask=True), batch, device="cpu")
    gpu = estimate(Attention(64, causal_mask=True), batch, device="cuda")
    # both convert the mask to float32 (100 x 100); the GPU's rows are padded to 112, and its log-sum-exp to 128
    padding, log_sum_exp = 100 * (112 - 100) * 4, 2 * 4 * (128 - 100) * 4
    assert padding + log_sum_exp <= gpu.plain.bytes - cpu.plain.bytes <= padding + log_sum_exp + 64


def test_a_head_dimension_the_fused_kernels_cannot_take_keeps_the_attention_probabilities():
    # head dimension 6 in float32: math attention on a GPU, which keeps softmax's 100 x 100 probabilities per head
    batch = torch.randn(2, 100, 24)
    cpu = estimate(Attention(24), batch, device="cpu")
    gpu = estimate(Attention(24), batch, device="cuda")
    assert gpu.plain.bytes - cpu.plain.bytes >= 2 * 4 * 100 * 100 * 4
    assert any("math 1 call" in n for n in gpu.notes)


def test_half_precision_flash_pads_a_head_dimension_to_a_multiple_of_8_and_keeps_the_padded_copies():
    batch = torch.randn(2, 100, 40, dtype=torch.bfloat16)  # 4 heads of 10: padded to 16
    cpu = estimate(Attention(40, torch.bfloat16), batch, device="cpu")
    gpu = estimate(Attention(40, torch.bfloat16), batch, device="cuda")
    assert gpu.plain.bytes - cpu.plain.bytes >= 3 * 2 * 4 * 100 * (16 - 10) * 2  # q, k and v's padding, kept
    assert any("flash 1 call" in n for n in gpu.notes)


def test_the_function_is_put_back_and_real_tensors_run_as_they_are():
    original = F.scaled_dot_product_attention
    x = torch.randn(1, 2, 8, 6)
    with pytest.raises(RuntimeError, match="inside"):
        with cuda_kernels() as counts:
            assert F.scaled_dot_product_attention is not original
            torch.testing.assert_close(F.scaled_dot_product_attention(x, x, x), original(x, x, x))
            raise RuntimeError("inside")
    assert F.scaled_dot_product_attention is original
    assert not counts  # a real call is not the GPU's to count


def test_grouped_query_attention_is_counted_as_the_cpu_keeps_it_and_said():
    class Grouped(Attention):
        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            b, n, width = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 4, width // 4).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True)  # 4 query heads, 2 key heads
            return self.out(o.transpose(1, 2).reshape(b, n, width)).pow(2).mean()

    batch = torch.randn(2, 100, 64)
    cpu, gpu = estimate(Grouped(64), batch, device="cpu"), estimate(Grouped(64), batch, device="cuda")
    assert gpu.plain.bytes == cpu.plain.bytes
    assert any("grouped-query heads counted as the CPU's flash kernel keeps them 1 call" in n for n in gpu.notes)
