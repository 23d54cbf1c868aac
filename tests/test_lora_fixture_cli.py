"""``fl-lightning lora-fixture DEST`` writes the offline fixture of docs/lora.md; the command it prints runs
a fedit_gpt2 config on it, quietly (no load report, no progress bars but the round bar)."""

from __future__ import annotations

import shlex

import torch

from fl_lightning.commands.cli import main


def test_the_printed_command_runs_the_sst2_config_offline_and_quietly(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main(["lora-fixture", str(tmp_path / "fx")])
    lines = capfd.readouterr().out.strip().splitlines()
    assert [line.split("--config ")[1].split()[0] for line in lines] == ["fedit_gpt2_sst2", "fedit_gpt2_qnli", "fedit_gpt2_20news"]
    assert all(line.startswith("HF_HUB_OFFLINE=1 fl-lightning fit --config ") for line in lines)
    args = shlex.split(lines[0])[2:]  # after "HF_HUB_OFFLINE=1 fl-lightning"
    small = ["--trainer.max_steps", "1", "--trainer.val_check_interval", "1", "--data.init_args.num_clients", "4",
             "--data.init_args.partition.init_args.alpha", "1.0", "--data.init_args.participation.init_args.clients_per_round", "2"]  # fmt: skip
    capfd.readouterr()
    threads = torch.get_num_threads()
    try:
        main([*args, *small])
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    assert out.strip().splitlines()[-1].startswith("LocalAdam: 1 rounds in ")
    for noise in ("MISSING", "Generating", "Map", "Downloading", "is_gradient_checkpointing", "test: "):
        assert noise not in err, noise
