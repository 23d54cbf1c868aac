"""Issue 20: known failures end in one line plus a hint (exit code 2), checked resumes,
and a client store that owns its folder."""

from pathlib import Path

import pytest

from fl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "2", "--trainer.logger", "false",
    "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval", "2",
]  # fmt: skip


def _cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *QUICK, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("fl-lightning: error: "), err
    return err[-1]


def test_a_model_that_does_not_fit_the_data_ends_in_one_line(tmp_path, capsys):
    """in_channels 3 on 1-channel digits: was 'trains 0 clients for 30 rounds and exits 0'."""
    line = _cli_error(
        capsys, "--model.model.init_args.in_channels", "3", "--trainer.callbacks", "[]",
        "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert "round 0: client" in line and "not a client fault" in line and "in_channels" in line
