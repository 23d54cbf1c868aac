"""``--threads auto|N``: torch's intra-op threads chosen by the model's size, applied before training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.run.threads import AUTO_SINGLE_THREAD_BELOW, apply_threads, choose_threads, parse_threads
from tests.test_cli import ROOT, fl_lightning


def test_auto_gives_small_models_one_thread_and_large_ones_all_cores():
    small = nn.Linear(10, 10)  # 110 parameters
    large = nn.Embedding(AUTO_SINGLE_THREAD_BELOW, 1)  # exactly the bound: not below it
    assert choose_threads("auto", small, cores=8) == 1
    assert choose_threads("auto", large, cores=8) == 8
    large.weight.requires_grad_(False)  # frozen weights count: they are still computed with
    assert choose_threads("auto", large, cores=8) == 8
    assert choose_threads(3, large, cores=8) == 3 and choose_threads("2", small, cores=8) == 2


@pytest.mark.parametrize("bad", [0, -1, "many", 1.5, True])
def test_a_bad_thread_count_is_one_line(bad):
    with pytest.raises(ValueError, match=r"^threads must be auto or an integer >= 1 \(torch intra-op threads\), got "):
        parse_threads(bad)


def test_apply_sets_torchs_threads():
    before = torch.get_num_threads()
    try:
        assert apply_threads(2, nn.Linear(2, 2)) == 2 and torch.get_num_threads() == 2
        assert apply_threads("auto", nn.Linear(2, 2)) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_result_line_names_the_thread_count(tmp_path):
    config = str(ROOT / "configs" / "quickstart.yaml")
    proc = fl_lightning("fit", "--config", config, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                        "--threads", "2", cwd=tmp_path)  # fmt: skip
    assert " in " in proc.stdout and " s on 2 threads · " in proc.stdout.strip().splitlines()[-1]
