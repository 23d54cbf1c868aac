"""FedRep (Collins et al., ICML 2021, Algorithm 1) = FedAlt with the head personal and personal_steps = the
head's steps (docs/algorithms.md, 25.7): configs/pfl_fedrep_digits.yaml against an independent FedRep."""

import torch

from fl_lightning.algorithms import FedAlt, FedBABU
from fl_lightning.commands.cli import build_cli
from tests.pfl_reference import (
    ROOT, assert_personal_metrics, batched_equals_sequential, compare_partial, fit, fit_config, record_uploads,
    shared_params,
)  # fmt: skip

HEAD = ["classifier.2"]


def test_the_config_is_fedalt_with_the_head_personal_and_head_steps_first():
    cli = build_cli(["--config", str(ROOT / "configs" / "pfl_fedrep_digits.yaml")], run=False)
    assert type(cli.model.algorithm) is FedAlt and cli.model.algorithm.personal_steps == 5
    assert cli.model.personal_names == ["classifier.2.weight", "classifier.2.bias"]
    assert cli.model.local.steps == 10  # 5 head steps, then 5 body steps


def test_fedrep_equals_an_independent_reference():
    """Head steps (body frozen) first, then body steps (head frozen), body averaged; the unseen client
    fine-tunes a head from the initial one, then trains a body it discards: global body + its new head."""
    differences = compare_partial(FedAlt(personal_steps=1), HEAD, head_steps=1)
    print("FedRep vs reference:", differences)
    assert max(v for k, v in differences.items() if k != "personal_moved") < 1e-6
    assert differences["personal_moved"] > 1e-3


def test_the_head_phase_comes_first():
    """The reference with the phases swapped (body steps first, then the head's) is far from FedAlt: FedAlt
    trains the head first."""
    from tests.pfl_reference import max_difference, reference_partial, cnn

    module = fit(FedAlt(personal_steps=1), HEAD)
    x_head_first = reference_partial(cnn(), module.personal_names, head_steps=1)[0]
    x_body_first = reference_partial(cnn(), module.personal_names, head_steps=1, head_first=False)[0]
    assert max_difference(shared_params(module), x_head_first) < 1e-6
    assert max_difference(shared_params(module), x_body_first) > 1e-3


def test_with_no_head_steps_the_global_model_is_fedbabus():
    """head_steps = 0: the heads never move and the body trains from the initial head each round, which is
    FedBABU's federated training (the head frozen at its initialisation), bit for bit."""
    fedrep, fedbabu = fit(FedAlt(personal_steps=0), HEAD), fit(FedBABU(head=HEAD, finetune_steps=0))
    for name, value in shared_params(fedrep).items():
        assert torch.equal(value, fedbabu.model.get_parameter(name).detach()), name
    for cid in fedrep.store.client_ids():
        for name, value in fedrep.client_personal(cid).items():
            assert torch.equal(value, fedrep.model.get_parameter(name).detach())


def test_the_head_never_leaves_the_client():
    algorithm = FedAlt(personal_steps=2)
    uploads = record_uploads(algorithm)
    module = fit(algorithm, HEAD)
    assert uploads and all(set(u["delta"]) == set(module.federated_names) for u in uploads)
    assert not any(k.startswith("classifier.2") for u in uploads for k in u["delta"])


def test_batched_execution_stacks_the_clients_and_equals_sequential_execution():
    batched_equals_sequential(lambda: FedAlt(personal_steps=2), HEAD)


def test_the_config_fits_through_the_cli_and_logs_personal_and_unseen_accuracy(tmp_path, monkeypatch):
    cli, rows = fit_config(tmp_path, monkeypatch, "pfl_fedrep_digits", "--model.local.steps", "4", "--model.algorithm.personal_steps", "2")
    assert cli.trainer.global_step == 3 and cli.model.algorithm.personal_steps == 2
    assert_personal_metrics(rows)
