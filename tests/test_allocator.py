"""lightning_memopt.allocator: the CUDA caching allocator's rules, each on a hand-built sequence that a wrong rule
would fail; the dry run's event log; estimate(device="cuda") on a machine without a GPU, with the modelled allocated
and reserved peaks, and None for them on CPU."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import estimate
from lightning_memopt.allocator import CachingAllocator, replay, round_size, segment_size
from lightning_memopt.estimate import cublas_workspace
from lightning_memopt.memory import CPUPeakTracker
from tests.helpers import Wrapped

KiB, MiB = 2**10, 2**20


def test_requests_are_rounded_up_to_512_bytes() -> None:
    allocator = CachingAllocator()
    assert [allocator.malloc(i, n) for i, n in enumerate((1, 512, 513, 1000))] == [512, 512, 1024, 1024]
    assert allocator.peaks.requested == 1 + 512 + 513 + 1000 and allocator.peaks.allocated == 3072
    assert allocator.malloc("empty", 0) == 0 and allocator.peaks.allocated == 3072  # a zero-byte request takes nothing
    assert round_size(0) == 512 and round_size(2048) == 2048


def test_the_small_pool_packs_requests_up_to_1_mib_into_2_mib_segments() -> None:
    allocator = CachingAllocator()
    allocator.malloc("a", MiB)  # the largest small request; its remainder (1 MiB, >= 512 B) split off and cached
    assert allocator.malloc("b", MiB - 512) == MiB - 512  # 512 B left: still split, as the small pool does
    assert allocator.malloc("c", 512) == 512  # that last 512 B: the segment full to the byte, no new one
    assert allocator.peaks.reserved == 2 * MiB and allocator.peaks.segments == 1 and allocator.allocated == 2 * MiB
    allocator.malloc("d", 512)
    assert allocator.peaks.reserved == 4 * MiB and allocator.peaks.segments == 2


def test_requests_between_1_and_10_mib_take_a_20_mib_segment() -> None:
    allocator = CachingAllocator()
    allocator.malloc("a", MiB + 1)  # just over the small pool: large
    assert allocator.peaks.reserved == 20 * MiB
    for key in "bcd":  # 4 x (1 MiB + 512 B): the remainder is always over 1 MiB, so split
        allocator.malloc(key, MiB + 1)
    assert allocator.peaks.reserved == 20 * MiB and allocator.allocated == 4 * (MiB + 512)
    allocator.malloc("e", 10 * MiB - 512)  # the largest that takes a 20 MiB segment: the 16 MiB cached one fits it
    assert allocator.peaks.reserved == 20 * MiB
    allocator.malloc("f", 5 * MiB)  # 6 MiB left there would do; but best fit splits what is left: 6 MiB - 512 B
    assert allocator.peaks.reserved == 20 * MiB
    assert [segment_size(n) for n in (MiB + 512, 10 * MiB - 512, 10 * MiB)] == [20 * MiB, 20 * MiB, 10 * MiB]


def test_large_requests_get_a_segment_rounded_to_2_mib_not_split_when_the_rest_is_small() -> None:
    allocator = CachingAllocator()
    assert allocator.malloc("a", 10 * MiB) == 10 * MiB and allocator.peaks.reserved == 10 * MiB
    # 11 MiB: a 12 MiB segment whose 1 MiB remainder is not over 1 MiB: the whole block is handed out
    assert allocator.malloc("b", 11 * MiB) == 12 * MiB
    assert allocator.peaks.reserved == 22 * MiB and allocator.allocated == 22 * MiB
    # 10.5 MiB: a 12 MiB segment, 1.5 MiB left over: split, and the remainder cached for a large request
    assert allocator.malloc("c", 10 * MiB + 512 * KiB) == 10 * MiB + 512 * KiB
    assert allocator.peaks.reserved == 34 * MiB
    # 1.2 MiB takes that 1.5 MiB remainder whole (0.3 MiB left is not worth a block); no 20 MiB segment
    assert allocator.malloc("d", 1200 * KiB) == 1536 * KiB and allocator.peaks.reserved == 34 * MiB


def test_freed_blocks_are_cached_and_reused_by_best_fit_within_their_pool() -> None:
    allocator = CachingAllocator()
    for key, size in (("big", 6 * MiB), ("gap1", 2 * MiB), ("small", 4 * MiB), ("gap2", 2 * MiB)):
        allocator.malloc(key, size)  # one 20 MiB segment: 6, 2, 4, 2 and 6 MiB cached
    allocator.free("big")
    allocator.free("small")
    # best fit: the 4 MiB block, taken whole (0.5 MiB left is not over 1 MiB); first fit would split the 6 MiB one
    assert allocator.malloc("x", 3 * MiB + 512 * KiB) == 4 * MiB
    assert allocator.peaks.reserved == 20 * MiB
    # a small request never takes a block of the large pool: a 2 MiB segment of its own
    allocator.malloc("tiny", 100)
    assert allocator.peaks.reserved == 22 * MiB


def test_a_freed_block_merges_with_its_free_neighbours() -> None:
    allocator = CachingAllocator()
    for key in "abc":
        allocator.malloc(key, 5 * MiB)  # 5 + 5 + 5 of a 20 MiB segment, 5 MiB cached after c
    allocator.free("a")
    allocator.free("b")  # merged with a: one 10 MiB block
    allocator.malloc("d", 9 * MiB)  # fits only in the merged block
    assert allocator.peaks.reserved == 20 * MiB
    allocator.free("c")  # merged with the 5 MiB cached after it (d took all 10 MiB: 1 MiB left is not split)
    allocator.malloc("e", 9 * MiB + 512 * KiB)  # fits only in that merged 10 MiB block
    assert allocator.peaks.reserved == 20 * MiB and allocator.allocated == 20 * MiB


def test_the_peaks_are_the_highest_at_any_moment_and_segments_are_kept() -> None:
    peaks = replay([("+", 1, 3 * MiB), ("+", 2, 100), ("-", 1, 3 * MiB), ("-", 2, 100), ("+", 3, 600)])
    assert (peaks.requested, peaks.allocated, peaks.reserved) == (3 * MiB + 100, 3 * MiB + 512, 22 * MiB)
    with pytest.raises(ValueError, match="allocated already"):
        replay([("+", 1, 10), ("+", 1, 10)])


def test_the_trackers_event_log_replays_to_its_own_peak_and_changes_no_figure() -> None:
    def work() -> None:
        a = torch.empty(1000)
        b = torch.empty(3000)
        del a
        c = torch.empty(200).mul_(2)
        del b, c

    with CPUPeakTracker() as plain:
        work()
    assert plain.events is None  # off by default
    with CPUPeakTracker() as tracker:
        alive = torch.empty(50)  # alive before the log starts: its first event
        events = tracker.record()
        work()
    assert (tracker.peak, tracker.current) == (plain.peak + 200, plain.current + 200)
    assert events[0] == ("+", 1, 200) and sum(1 for e in events if e[0] == "+") == 4
    assert replay(events).requested == tracker.peak
    del alive


@pytest.fixture(scope="module")
def encoder_estimates() -> dict[str, object]:
    model = Wrapped("torch_encoder")
    batch = next(iter(model.train_dataloader()))
    return {device: estimate(model, batch, "fit", device=device) for device in ("cpu", "cuda")}


def test_a_cuda_estimate_runs_without_a_gpu_and_models_the_allocator(encoder_estimates: dict) -> None:
    cpu, cuda = encoder_estimates["cpu"], encoder_estimates["cuda"]
    assert cuda.device == "cuda" and cpu.device == "cpu"
    for on_cpu, on_cuda in ((cpu.plain, cuda.plain), (cpu.memopt, cuda.memopt)):
        # requested: the same weights, gradients and optimizer state; more activations, as the GPU's attention
        # kernel keeps them (its output in its own layout, copied by nn.MultiheadAttention: tests/test_kernels.py)
        assert {k: n for k, n in on_cuda.by_kind.items() if k != "activations"} == {
            k: n for k, n in on_cpu.by_kind.items() if k != "activations"
        }
        assert on_cuda.by_kind["activations"] > on_cpu.by_kind["activations"]
        assert on_cpu.allocated is None and on_cpu.reserved is None  # never guessed on CPU
        if torch.cuda.is_available():
            continue
        # no GPU here and no CUBLAS_WORKSPACE_CONFIG: no workspace, so every block is a multiple of 512 B
        assert on_cuda.bytes <= on_cuda.allocated <= on_cuda.reserved
        assert on_cuda.allocated % 512 == 0 and on_cuda.reserved % (2 * MiB) == 0
    assert cuda.memopt.allocated < cuda.plain.allocated
    assert "the caching allocator (modelled): plain allocated" in str(cuda)
    assert "caching allocator" not in str(cpu)
    plain = cuda.as_dict()["plain"]
    assert (plain["allocated_peak_bytes"], plain["reserved_peak_bytes"]) == (cuda.plain.allocated, cuda.plain.reserved)
    assert cpu.as_dict()["plain"]["allocated_peak_bytes"] is None
    if not torch.cuda.is_available():
        assert any("not on this machine" in n for n in cuda.notes)
        assert any("cuBLAS's workspace is not counted" in n for n in cuda.notes)
        assert any(n.startswith("attention counted as a GPU") and "memory-efficient" in n for n in cuda.notes)


def test_cublas_workspace_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for config, size in ((":4096:8", 32 * MiB), (":4096:2:16:8", 8 * MiB + 128 * KiB), (":16:8", 128 * KiB)):
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
        assert cublas_workspace(torch.device("cuda")) == size
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    if not torch.cuda.is_available():
        assert cublas_workspace(torch.device("cuda")) is None  # the GPU's capability is unknown here


def test_cublas_workspace_counts_once_per_thread_running_matrix_products(
    encoder_estimates: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # 32 MiB: a segment of its own, never freed
    model = Wrapped("torch_encoder")
    batch = next(iter(model.train_dataloader()))
    fit = estimate(model, batch, "fit", device="cuda", checkpointing=False, chunked_loss=False, free_gradients=False)
    without = encoder_estimates["cuda"].plain
    assert fit.cublas_workspace == 32 * MiB and fit.plain.bytes == without.bytes
    # the step's thread and autograd's for the backward pass: one workspace each
    assert fit.plain.reserved == without.reserved + 2 * 32 * MiB
    # without gradients only the step's thread: one workspace (the encoder's eval fast path is one fused op, so a
    # plain linear layer stands in)
    linear = Linear()
    predict = estimate(linear, torch.zeros(4, 8), "predict", device="cuda")
    assert predict.plain.reserved == 32 * MiB + 2 * MiB


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def test_a_module_on_the_meta_device_is_estimated_for_cuda_at_fit() -> None:
    """A fake CUDA tensor that requires grad aborts a CPU-only torch (autograd asks for the device's guard): the dry
    runs for a GPU this machine lacks, the planner's too, must stay on the CPU's fake tensors."""
    with torch.device("meta"):
        model, batch = Linear(), torch.empty(4, 8)
    cpu, cuda = (estimate(model, batch, "fit", device=device) for device in ("cpu", "cuda"))
    assert cuda.plain.bytes == cpu.plain.bytes > 0 and cuda.memopt.bytes == cpu.memopt.bytes
    assert cuda.plain.reserved == 2 * MiB and cpu.plain.reserved is None


def test_devices_and_budgets_this_machine_cannot_resolve_still_raise() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model = Wrapped("torch_encoder")
    batch = next(iter(model.train_dataloader()))
    with pytest.raises(ValueError, match="share of the memory of 'cuda'"):
        estimate(model, batch, device="cuda", memory_budget=0.5)
    if not hasattr(torch, "xpu") or not torch.xpu.is_available():
        with pytest.raises(ValueError, match="is not available to this torch"):
            estimate(model, batch, device="xpu")
