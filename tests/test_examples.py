"""Every example runs (the new ones in quick mode), so none can rot; the LightningCLI example is run by test_cli.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses: run by CI with `python -m pytest -m slow`

DOCS = Path(__file__).parent.parent / "docs"
EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
NO_FLAGS = {"demo.py"}  # the demo takes no arguments; the others take --quick


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path, tmp_path: Path) -> None:
    args = [] if example.name in NO_FLAGS else ["--quick"]
    result = subprocess.run(
        [sys.executable, str(example), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    if example.name == "demo.py":
        assert "fit: DDPM UNet2DModel" in result.stdout and "predict: Latte-style transformer" in result.stdout
    elif example.name == "estimate_real_scale.py":  # prints its tables; logs nothing
        assert "| Latte-1 + VAE decode, 2 frames | predict | none |" in result.stdout
        assert "| SD-1.5 UNet + VAE decode, 2 images | predict | 0.4 x plain |" in result.stdout
        assert "| tiny Llama + LoRA r=16, bf16, 2,048 tokens | fit | none |" in result.stdout
        assert "| tiny Llama + LoRA r=16, bf16, 512 tokens | fit | none | **yes**, weights_8bit=True |" in result.stdout
        assert "loss: in chunks" in result.stdout
        assert "nothing of the models' size allocated" in result.stdout
    elif example.name == "estimate_below_floors.py":  # one row per workload; logs nothing
        for title in ("SD-1.5 UNet", "SDXL UNet", "Llama-3-8B", "FLUX.1-dev"):
            assert f"| tiny stand-in: {title}" in result.stdout, title
        assert "bf16 base, 8 tokens |" in result.stdout and "bf16 base, 256 tokens |" in result.stdout
        assert "(no budget)" in result.stdout and "nothing of the models' size" in result.stdout
    elif example.name == "estimate_ranks.py":  # one rank of 8 under FSDP2, from one process; logs nothing
        assert "per rank of 8 under ModelParallelStrategy" in result.stdout
        assert "| tiny Llama, AdamW, bf16, 512 tokens a rank | `MemOpt(optimizer_in_backward=True)` |" in result.stdout
        assert "optimizer step in the backward pass" in result.stdout
        assert "DeepSpeed ZeRO-3" in result.stdout and "nothing of the models' size allocated" in result.stdout
    elif example.name == "estimate_recompute.py":  # prints its table; logs nothing
        assert "| tiny UNet training, batch 2, 8x8 latents | checkpointing=True | none |" in result.stdout
        assert "| tiny Llama + LoRA r=16 on q/k/v/o, sequence 64 | whole blocks (before) |" in result.stdout
        assert "nothing of the models' size allocated" in result.stdout
    elif example.name == "custom_technique.py":  # a user's technique, planned under the budget, logged, undone
        assert "MemOpt: prefetch depths " in result.stdout + result.stderr
        assert "model left as given" in result.stdout and "'prefetch': {'layers': [" in result.stdout
        (log,) = (tmp_path / "lightning_logs").rglob("metrics.csv")
        assert "memopt/prefetch_slots" in log.read_text() and "memopt/peak_bytes" in log.read_text()
    else:
        logs = list((tmp_path / "lightning_logs").rglob("metrics.csv"))
        assert logs, f"{example.name} wrote no lightning_logs/**/metrics.csv under {tmp_path}"
        assert any("memopt/peak_bytes" in log.read_text() for log in logs), [str(log) for log in logs]


def test_the_techniques_page_example_runs(tmp_path: Path) -> None:
    """The complete example on the "Your own technique" page (docs/techniques.md) runs as it is printed there."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "techniques.md").read_text(), re.DOTALL)
    (code,) = [block for block in blocks if "trainer.fit(model)" in block]
    (tmp_path / "technique.py").write_text(code)
    result = subprocess.run([sys.executable, "technique.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    # what it chooses depends on the device's measured speeds; that it meets the budget does not
    last = re.search(r"(\d) of 4 blocks \| depths [\d, ]+ \| (\d+) bytes, budget (\d+)\n$", result.stdout)
    assert last is not None, result.stdout[-2000:]
    assert int(last.group(2)) <= int(last.group(3))
