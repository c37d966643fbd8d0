"""Every example runs, so none can rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path) -> None:
    result = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    if example.name == "demo.py":
        assert "fit: DDPM UNet2DModel" in result.stdout and "predict: Latte-style transformer" in result.stdout
