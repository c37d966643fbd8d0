"""MemOpt at fit: the peak training memory drops, loss and every gradient stay equal, the model is restored."""

from __future__ import annotations

import pytest
import torch

from lightning_memopt import PeakMemory
from tests.helpers import FIT_CASES, Wrapped, fingerprint, heavy, memopt_fit, trainer


def native_switch(net: torch.nn.Module) -> bool:
    """Switch the model library's own checkpointing on by hand, as a user would. False if it has none."""
    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable()
    elif hasattr(base, "enable_gradient_checkpointing"):
        base.enable_gradient_checkpointing()
    else:
        return False
    return True


def run_fit(case: str, mode: str) -> tuple[Wrapped, PeakMemory]:
    if mode == "memopt":  # MemOpt() before the probe: computed once per case (helpers.memopt_fit)
        fitted = memopt_fit(case)
        return fitted.model, fitted.probe
    model = Wrapped(case)
    probe = PeakMemory()
    if mode == "native" and not native_switch(model.net):
        pytest.skip(f"{case} has no native switch")
    trainer(probe).fit(model)
    return model, probe


def assert_same_training(a: Wrapped, b: Wrapped) -> None:
    torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(b.losses), rtol=1e-5, atol=0)
    assert len(a.grads) == len(b.grads) == 2
    for step_a, step_b in zip(a.grads, b.grads, strict=True):
        assert step_a.keys() == step_b.keys() and step_a
        for name in step_a:
            torch.testing.assert_close(step_a[name], step_b[name], rtol=1e-5, atol=1e-8, msg=name)


#: The fit cases, the heaviest (a UNet2DCondition with LoRA, SD3, DiT and BERT) in the slow run only; the tests of a
#: case in one xdist group, which runs its MemOpt() fit once.
SLOW = ("unet2d_condition_lora", "sd3", "dit", "bert")
CASES = heavy(FIT_CASES, *SLOW, group="fit")


@pytest.mark.parametrize("case", CASES)
def test_fit_lowers_peak_and_keeps_results(case: str) -> None:
    plain, plain_probe = run_fit(case, "plain")
    fitted = memopt_fit(case)
    model, before, probe, memopt = fitted.model, fitted.before, fitted.probe, fitted.memopt

    assert memopt.applied and memopt.applied[0].technique == "checkpointing"
    assert probe.peak < plain_probe.peak
    assert_same_training(plain, model)
    assert fingerprint(model.net) == before


@pytest.mark.parametrize("case", [c for c in CASES if c.values != ("torch_encoder",)])
def test_fit_saves_at_least_as_much_as_the_native_switch(case: str) -> None:
    native, native_probe = run_fit(case, "native")
    model, probe = run_fit(case, "memopt")
    assert probe.peak <= native_probe.peak
    assert_same_training(native, model)


@pytest.mark.xdist_group("fit_peft_llama")
def test_lora_gradients_reach_the_adapter_weights() -> None:
    model, _ = run_fit("peft_llama", "memopt")
    lora = [name for name in model.grads[0] if "lora_" in name]
    assert lora and all(model.grads[0][n].abs().sum() > 0 for n in lora)
    assert all("lora_" in name for name in model.grads[0])  # the frozen base gets no gradient
