"""memory_budget="auto": parsed, resolved on CPU (MemAvailable plus what the process holds) and on a faked CUDA device
(free memory plus what the caching allocator holds), less 5%; said in words; refused where it means nothing; and used
by a fit and by estimate()."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from lightning_memopt import MemOpt, PeakMemory, estimate, tuning
from lightning_memopt.tuning import AUTO_MARGIN, auto_budget, budget_for, parse_budget, resolve_budget
from lightning_memopt.units import fmt_bytes
from tests.helpers import Wrapped, trainer

GIB = 2**30


@pytest.fixture
def fake_cpu(monkeypatch):
    """This machine with 6 GiB available and 2 GiB held by the process."""
    figures = {"/proc/meminfo": ("MemAvailable", 6 * GIB), "/proc/self/status": ("RssAnon", 2 * GIB)}

    def proc_kib(path: str, field: str) -> int:
        name, value = figures[path]
        assert field == name
        return value // 1024

    monkeypatch.setattr(tuning, "_proc_kib", proc_kib)
    return int(8 * GIB * (1 - AUTO_MARGIN))


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device 1 with 30 GiB free of 80 GiB, and 10 GiB reserved by this process's caching allocator."""
    asked: list[object] = []

    def mem_get_info(device=None):
        asked.append(device)
        return 30 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GIB)
    return asked


@pytest.mark.parametrize("value", ["auto", "AUTO", " Auto "])
def test_auto_parses_in_any_case(value: str) -> None:
    assert parse_budget(value) == "auto"
    assert MemOpt(memory_budget=value).config.memory_budget == "auto"


@pytest.mark.parametrize("value", ["automatic", "auto%", "auto auto", "auto12GiB", "0.5auto"])
def test_near_misses_of_auto_are_refused_naming_the_value(value: str) -> None:
    with pytest.raises(ValueError, match=f"`memory_budget` must be .*'auto', got {value!r}"):
        parse_budget(value)
    with pytest.raises(ValueError, match=f"got {value!r}"):
        MemOpt(memory_budget=value)


def test_on_cpu_auto_is_the_available_memory_plus_what_the_process_holds_less_the_margin(fake_cpu) -> None:
    assert resolve_budget("auto", torch.device("cpu")) == fake_cpu == int(0.95 * 8 * GIB)
    auto = auto_budget("cpu")
    assert (auto.device, auto.free, auto.held, auto.bytes) == ("cpu", 6 * GIB, 2 * GIB, fake_cpu)


def test_on_cpu_auto_reads_this_machine() -> None:
    """The real /proc figures: more than nothing, less than the machine's RAM, and what the words say."""
    auto = auto_budget("cpu")
    assert 0 < auto.bytes < tuning.total_memory(torch.device("cpu"))
    assert auto.held > 0 and auto.bytes == int((auto.free + auto.held) * (1 - AUTO_MARGIN))
    assert auto.words.startswith(f"memory_budget='auto': {fmt_bytes(auto.bytes)}, the memory of this machine")


def test_proc_fields_are_read_in_kib(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683792 kB\nMemFree:        13537316 kB\nMemAvailable:   21632496 kB\n")
    assert tuning._proc_kib(str(meminfo), "MemAvailable") == 21632496
    with pytest.raises(KeyError):
        tuning._proc_kib(str(meminfo), "RssAnon")


def test_without_proc_psutil_is_read_and_without_either_auto_is_refused(monkeypatch) -> None:
    def no_proc(path: str, field: str) -> int:
        raise OSError(path)

    monkeypatch.setattr(tuning, "_proc_kib", no_proc)
    fake = types.SimpleNamespace(
        virtual_memory=lambda: types.SimpleNamespace(available=3 * GIB),
        Process=lambda: types.SimpleNamespace(memory_info=lambda: types.SimpleNamespace(rss=GIB)),
    )
    monkeypatch.setitem(sys.modules, "psutil", fake)
    assert resolve_budget("auto", torch.device("cpu")) == int(4 * GIB * (1 - AUTO_MARGIN))
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    with pytest.raises(ValueError, match="`memory_budget` 'auto' on CPU reads .* give a size"):
        resolve_budget("auto", torch.device("cpu"))


def test_on_cuda_auto_is_the_free_memory_plus_what_the_allocator_holds_less_the_margin(fake_cuda) -> None:
    """Reserved bytes are used to other processes but free to this one's tensors; mem_get_info's free already leaves
    out every CUDA context, so nothing more is subtracted."""
    budget, words = budget_for("auto", torch.device("cuda:1"))
    assert budget == int(40 * GIB * (1 - AUTO_MARGIN)) == 40802189312
    assert fake_cuda == [torch.device("cuda:1")]  # the device asked about, not the current one by default
    assert words == (
        "memory_budget='auto': 38.00 GiB, the memory of cuda:1 free to this process at the start (40.00 GiB: 30.00 GiB"
        " free and 10.00 GiB its caching allocator held) less 5% for the allocator's rounding and fragmentation"
    )


def test_cuda_without_an_index_is_the_current_device(fake_cuda) -> None:
    auto = auto_budget("cuda")
    assert auto.device == "cuda:1" and fake_cuda == [torch.device("cuda:1")]
    assert auto.words.startswith("memory_budget='auto': 38.00 GiB, the memory of cuda:1")


def test_words_on_cpu_and_only_for_auto(fake_cpu) -> None:
    assert budget_for("auto", torch.device("cpu")) == (
        fake_cpu,
        "memory_budget='auto': 7.60 GiB, the memory of this machine available to this process at the start (8.00 GiB:"
        " 6.00 GiB available and 2.00 GiB it held) less 5% for the allocator's rounding and fragmentation",
    )
    for other, expected in ((12 * GIB, 12 * GIB), (0.5, tuning.total_memory(torch.device("cpu")) // 2), (None, None)):
        assert budget_for(other, torch.device("cpu")) == (expected, None)


def test_auto_on_the_meta_device_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="`memory_budget` 'auto' .* the meta device has none"):
        resolve_budget("auto", torch.device("meta"))


def test_auto_on_a_device_this_machine_lacks_is_refused_naming_it(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="`memory_budget` 'auto' is the memory free on 'cuda:0' .* does not have it"):
        resolve_budget("auto", torch.device("cuda:0"))


def test_other_budgets_resolve_as_before(fake_cpu) -> None:
    assert resolve_budget(1234, torch.device("cpu")) == 1234 and resolve_budget(None, torch.device("cpu")) is None
    assert resolve_budget(0.5, torch.device("cpu")) == tuning.total_memory(torch.device("cpu")) // 2


@pytest.mark.slow  # a fit planned under a budget: 5 s
def test_a_fit_under_auto_works_to_what_auto_resolved_to(monkeypatch) -> None:
    """The budget the report gives is the one resolve_budget read; made small enough, from the memory MemOpt's plan
    and the plain step need, it is met by checkpointing where plain would miss it."""
    model = Wrapped("torch_encoder")
    batch = next(iter(model.train_dataloader()))
    figures = estimate(Wrapped("torch_encoder"), batch, "fit", checkpointing="auto")
    assert figures.memopt.bytes < figures.plain.bytes
    room = (figures.memopt.bytes + figures.plain.bytes) // 2
    held = 1000
    free = int(room / (1 - AUTO_MARGIN)) - held
    monkeypatch.setattr(tuning, "_cpu_memory", lambda: (free, held))
    expected = resolve_budget("auto", torch.device("cpu"))
    assert figures.memopt.bytes < expected < figures.plain.bytes
    memopt, probe = MemOpt(memory_budget="auto", checkpointing="auto"), PeakMemory()
    trainer(memopt, probe).fit(model)
    report = memopt.reports["fit"]
    assert report.budget_bytes == expected
    assert max(probe.peaks) <= expected, probe.peaks
    (said,) = [note for note in report.notes if note.startswith("memory_budget='auto': ")]
    assert said == auto_budget("cpu").words  # the report says what it resolved to


@pytest.mark.slow  # estimates planned under 'auto': 2 s
def test_estimate_under_auto_resolves_on_the_estimates_device(fake_cpu) -> None:
    """A model built on the meta device, estimated for CPU: 'auto' is this machine's memory."""
    with torch.device("meta"):
        model = Wrapped("torch_encoder")
    batch = next(iter(Wrapped("torch_encoder").train_dataloader()))
    result = estimate(model, batch, "fit", memory_budget="auto", checkpointing="auto")
    assert result.budget_bytes == fake_cpu and result.fits(result.budget_bytes)
    with pytest.raises(ValueError, match="the meta device has none"):
        estimate(model, batch, "fit", device="meta", memory_budget="auto")
