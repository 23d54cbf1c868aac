"""The README's Python example runs quietly and gives the quickstart's numbers (4 rounds here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it from Python"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    return code[: code.index("```")]


def test_the_python_example_is_quiet_and_matches_the_cli(tmp_path):
    code = _example()
    assert "max_steps=100, val_check_interval=10" in code
    short = code.replace("max_steps=100, val_check_interval=10", "max_steps=4, val_check_interval=2")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FL_LIGHTNING_VERBOSE", None)
    example = subprocess.run([sys.executable, "-c", short], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert example.returncode == 0, example.stderr[-3000:]
    for noise in ("Epoch 0", "Tip", "GPU available", "Seed set", "v_num"):
        assert noise not in example.stdout + example.stderr, noise
    (test_acc,) = re.findall(r"test/acc\s*│\s*([0-9.]+)", example.stdout)

    exe = Path(sys.executable).with_name("fl-lightning")
    cli = subprocess.run([str(exe), "fit", "--config", "quickstart", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    line = cli.stdout.strip().splitlines()[-1]
    assert f"test acc {float(test_acc):.4f} (final model)" in line, (test_acc, line)
