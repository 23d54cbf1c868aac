"""Compression on the message pipeline (docs/algorithms.md, section 21): stages, byte accounting,
refused combinations, batched = sequential, resume with error feedback, the CLI."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FedAvg, LocalTraining
from fl_lightning.core import params as P
from fl_lightning.algorithms import SCAFFOLD, FAdamGT, FedDyn
from fl_lightning.commands.cli import main
from fl_lightning.compression import QSGD, Cast, Compression, RandomK, ScaledSign, TopK, sparse_bytes
from fl_lightning.compression.stages import CompressBroadcast, CompressUploads
from fl_lightning.pipeline.messages import StageKey
from fl_lightning.engine.module import FederatedModule
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]


def _module(algorithm=None, compression=None, execution="sequential"):
    torch.manual_seed(0)
    return FederatedModule(
        MLP(in_features=8, num_classes=3, hidden=[16]), algorithm or FedAvg(), LocalTraining(lr=0.1, steps=3, batch_size=8),
        execution=execution, compression=compression,
    )  # fmt: skip


def _fit(module, tmp_path, rounds=3, **kw):
    tiny_trainer(tmp_path, rounds, **kw).fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3))
    return module


def test_compression_without_compressors_is_todays_run_bitwise(tmp_path):
    plain = _fit(_module(SCAFFOLD()), tmp_path / "a")
    empty = _fit(_module(SCAFFOLD(), Compression()), tmp_path / "b")
    assert not empty.messages
    for a, b in zip(plain.model.parameters(), empty.model.parameters()):
        assert torch.equal(a, b)
    assert plain.store.equal(empty.store) and plain.comm_totals == empty.comm_totals


def test_upload_stage_keeps_a_residual_per_entry():
    x = {"w": torch.tensor([3.0, -1.0, 0.5, 2.0]), "b": torch.tensor([0.25])}
    stage = CompressUploads(TopK(k=1))
    sent = stage.apply({"delta": x, "delta_c": P.scale(x, 2.0)}, {}, StageKey(1, 0, 0))
    assert sent.message["delta"]["w"].tolist() == [3.0, 0.0, 0.0, 0.0] and sent.message["delta"]["b"].tolist() == [0.25]
    assert sent.state["delta"]["w"].tolist() == [0.0, -1.0, 0.5, 2.0] and sent.state["delta_c"]["w"].tolist() == [0.0, -2.0, 1.0, 4.0]
    assert sent.nbytes == 2 * ((4 + 1) + (4 + 1))  # per entry: w keeps 1 of 4 (a 2-bit index), b its one entry (a 1-bit field)
    # the next round: the residual is added (2.0 + 2.0 = 4.0 now leads); an entry not sent keeps its residual
    again = stage.apply({"delta": x}, sent.state, StageKey(1, 1, 0))
    assert again.message["delta"]["w"].tolist() == [0.0, 0.0, 0.0, 4.0]
    assert again.state["delta"]["w"].tolist() == [3.0, -2.0, 1.0, 0.0] and again.state["delta_c"] is sent.state["delta_c"]
    assert CompressUploads(TopK(k=1), error_feedback=False).apply({"delta": x}, {}, StageKey(1, 0, 0)).state == {}


def test_flattened_message_is_one_vector():
    x = {"w": torch.tensor([3.0, -1.0, 0.5, 2.0]), "b": torch.tensor([5.0])}
    sent = CompressUploads(TopK(k=2), flatten=True).apply({"delta": x}, {}, StageKey(1, 0, 0))
    assert sent.message["delta"]["w"].tolist() == [3.0, 0.0, 0.0, 0.0] and sent.message["delta"]["b"].tolist() == [5.0]
    assert sent.nbytes == sparse_bytes(5, 2, 4)


def test_broadcast_stage_sends_the_first_message_whole_then_compressed_changes():
    stage = CompressBroadcast(Cast("bfloat16"))
    v0 = {"x": {"w": torch.tensor([1.0, 2.0])}}
    first = stage.apply(v0, {}, StageKey(1, 0))
    assert torch.equal(first.message["x"]["w"], v0["x"]["w"]) and first.nbytes == 8  # uncompressed, float32
    v1 = {"x": {"w": torch.tensor([1.0 + 2**-10, 2.0 + 3 * 2**-12])}}
    second = stage.apply(v1, first.state, StageKey(1, 1))
    change = v1["x"]["w"] - v0["x"]["w"]
    assert second.nbytes == 4  # two bfloat16
    assert torch.equal(second.message["x"]["w"], v0["x"]["w"] + change.to(torch.bfloat16).float())
    assert torch.equal(second.state["x"]["w"], second.message["x"]["w"])  # the clients' copy h
    plain = CompressBroadcast(Cast("bfloat16"), error_feedback=False).apply(v1, {}, StageKey(1, 1))
    assert plain.state == {} and plain.nbytes == 4 and torch.equal(plain.message["x"]["w"], v1["x"]["w"].to(torch.bfloat16).float())


def test_round_bytes_are_the_encoded_sizes(tmp_path):
    """SCAFFOLD sends two model-shaped entries each way: top-k up, QSGD changes down after a whole first broadcast."""
    module = _fit(_module(SCAFFOLD(), Compression(up=TopK(ratio=0.1), down=QSGD(levels=4))), tmp_path, rounds=2)
    sizes = [p.numel() for p in module.model.parameters()]
    up = 2 * sum(sparse_bytes(d, math.ceil(0.1 * d), 4) for d in sizes)
    down_first, down_later = 2 * 4 * sum(sizes), 2 * sum(4 + math.ceil(d * 4 / 8) for d in sizes)  # 1 sign + 3 level bits
    assert module.comm_totals == {"bytes_up": 2 * 3 * up, "bytes_down": 3 * (down_first + down_later), "client_uploads": 6}
    residuals = {n for cid in module.store.client_ids() for n in module.store.get(cid, dict)}
    assert residuals == {"c", "msg:compress:delta", "msg:compress:delta_c"}


@pytest.mark.parametrize("algorithm", [SCAFFOLD, lambda: FedDyn(alpha=0.1), FAdamGT])
def test_biased_compressor_without_error_feedback_is_refused_for_mirrored_state(tmp_path, algorithm):
    module = _module(algorithm(), Compression(up=ScaledSign(), error_feedback_up=False))
    with pytest.raises(ValueError, match=r"compression.up=ScaledSign is biased and compression.error_feedback_up is false: \w+'s server state sums"):
        _fit(module, tmp_path)


def test_unbiased_or_error_feedback_or_stateless_runs(tmp_path):
    _fit(_module(SCAFFOLD(), Compression(up=QSGD(levels=2), error_feedback_up=False)), tmp_path / "a", rounds=1)
    _fit(_module(SCAFFOLD(), Compression(up=ScaledSign())), tmp_path / "b", rounds=1)
    _fit(_module(FedAvg(), Compression(up=TopK(ratio=0.1), error_feedback_up=False)), tmp_path / "c", rounds=1)


@pytest.mark.parametrize(
    "compressor, feedback", [(QSGD(levels=2), False), (RandomK(ratio=0.5, unbiased=True), False), (ScaledSign(), True), (RandomK(ratio=0.5), True)]
)
def test_uplink_error_feedback_defaults_to_auto_for_mirrored_state(tmp_path, compressor, feedback):
    """error_feedback_up's default: off for unbiased compressors (SCAFFOLD's mirrored delta_c runs without a
    residual, as an explicit false does), on for biased ones (whose refusal needs an explicit false)."""
    module = _fit(_module(SCAFFOLD(), Compression(up=compressor)), tmp_path, rounds=2)
    stored = {n for cid in module.store.client_ids() for n in module.store.get(cid, dict)}
    assert module.compression.feedback_up is feedback
    assert ({"msg:compress:delta", "msg:compress:delta_c"} <= stored) is feedback and ("msg:compress:delta" in stored) is feedback


def test_resuming_a_run_with_uplink_residuals_without_error_feedback_warns_once(tmp_path, caplog):
    """A checkpoint of QSGD uploads with error feedback (the former default) resumed under the new default
    (off for QSGD): the clients' residuals are not sent, and the run says so once, naming the setting."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    before = _module(FedAvg(), Compression(up=QSGD(levels=2), error_feedback_up=True))
    tiny_trainer(tmp_path / "a", 2, enable_checkpointing=True, callbacks=[checkpoint]).fit(
        before, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3))
    assert any(n == "msg:compress:delta" for cid in before.store.client_ids() for n in before.store.get(cid, dict))
    after = _module(FedAvg(), Compression(up=QSGD(levels=2)))
    with caplog.at_level("WARNING", logger="fl_lightning.compression.stages"):
        tiny_trainer(tmp_path / "b", 6).fit(
            after, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    warned = [r.getMessage() for r in caplog.records if "holds uplink compression residuals (delta)" in r.getMessage()]
    assert len(warned) == 1 and "set compression.error_feedback_up true" in warned[0], caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fl_lightning.compression.stages"):
        _fit(_module(FedAvg(), Compression(up=QSGD(levels=2))), tmp_path / "c", rounds=3)  # a fresh run: nothing to say
    assert "residuals" not in caplog.text


def test_explicit_uplink_error_feedback_with_an_unbiased_compressor_warns_the_shrink(caplog):
    """error_feedback_up: true with QSGD runs (configs that relied on the old default), warning 1 + omega
    computed for the model's tensors: MLP(8, 3, [16]) has 128, 16, 48 and 3 entries; QSGD s = 2,
    omega = min(d/4, sqrt(d)/2): 1 + omega = 6.66 (128), 3 (16), 4.46 (48), 1.75 (3)."""
    with caplog.at_level("WARNING", logger="fl_lightning.compression.stages"):
        module = _module(FedAvg(), Compression(up=QSGD(levels=2), error_feedback_up=True))
    assert module.compression.feedback_up is True
    warned = [r.getMessage() for r in caplog.records if "error_feedback_up is true" in r.getMessage()]
    assert len(warned) == 1 and "1 + omega = 1.75 to 6.66 for net.1.weight" in warned[0] and "up to 6.66x smaller" in warned[0], warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="fl_lightning.compression.stages"):
        _module(FedAvg(), Compression(up=QSGD(levels=2), error_feedback_up=True, flatten=True))  # one vector of 195 entries
        _module(FedAvg(), Compression(up=QSGD(levels=2)))  # the default: no warning
        _module(FedAvg(), Compression(up=TopK(ratio=0.5), error_feedback_up=True))  # biased: error feedback as it should be
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "1 + omega = 7.98 for the flattened message, so" in warned[0], warned


@pytest.mark.parametrize("algorithm", [FedAvg, SCAFFOLD])
def test_batched_equals_sequential_with_random_compressors(tmp_path, algorithm):
    """QSGD and random-k draw from (seed, round, client): stacked clients send what sequential ones do."""
    compression = Compression(up=QSGD(levels=8), down=RandomK(ratio=0.5), error_feedback_up=True)  # residuals on both links
    seq = _fit(_module(algorithm(), compression, "sequential"), tmp_path / "s")
    bat = _fit(_module(algorithm(), compression, "batched"), tmp_path / "b")
    assert not bat.executor.inner.inner.fallbacks
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sa, sb = seq.store.state_dict(), bat.store.state_dict()
    assert sa.keys() == sb.keys() and any("msg:compress:" in k for k in sa)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)
    assert seq.comm_totals == bat.comm_totals


def _resumable(tmp_path, rounds, ckpt_path=None):
    module = _module(SCAFFOLD(), Compression(up=TopK(ratio=0.2), down=QSGD(levels=4)))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3), ckpt_path=ckpt_path)
    return module


def test_resume_with_error_feedback_on_both_links_is_bitwise(tmp_path):
    straight = _resumable(tmp_path / "a", 6)
    _resumable(tmp_path / "b", 3)
    resumed = _resumable(tmp_path / "c", 6, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert straight.store.equal(resumed.store)  # the clients' residuals included
    down = straight.messages.state_dict()
    assert down and down.keys() == resumed.messages.state_dict().keys()  # the server's copies of the broadcast
    assert all(torch.equal(v, resumed.messages.state_dict()[k]) for k, v in down.items())
    assert straight.comm_totals == resumed.comm_totals


def test_fit_from_the_config_logs_encoded_bytes(tmp_path, monkeypatch):
    """configs/fedavg_topk_digits.yaml end to end: top-10 % uploads, bfloat16 broadcast changes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fl-lightning"])
    main(["fit", "--config", str(ROOT / "configs" / "fedavg_topk_digits.yaml"), "--trainer.max_steps", "3",
          "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
          "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    rows = [r for r in csv.DictReader(open(next(tmp_path.glob("fedavg_topk_digits/version_0/metrics.csv")))) if r["comm/round_bytes_up"]]
    from models import SmallCNN

    sizes = [p.numel() for p in SmallCNN(in_channels=1, num_classes=10, image_size=8).parameters()]
    up = sum(sparse_bytes(d, math.ceil(0.1 * d), 4) for d in sizes)
    assert [float(r["comm/round_bytes_up"]) for r in rows] == [5.0 * up] * 3
    assert [float(r["comm/round_bytes_down"]) for r in rows] == [5.0 * 4 * sum(sizes)] + [5.0 * 2 * sum(sizes)] * 2
    assert float(rows[-1]["comm/cumulative_bytes"]) == 15 * up + 5 * 4 * sum(sizes) + 10 * 2 * sum(sizes)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.compression.up", "TopK", "--model.compression.up.k", "0"], "TopK.k must be an integer >= 1, got 0"),
        (["--model.compression.up", "TopK", "--model.compression.up.k", "100000"], "TopK.k must be <= the size of every tensor it compresses, got k=100000 for compression.up on"),
        (["--model.compression.down", "RandomK", "--model.compression.down.ratio", "0"], "RandomK.ratio must be in (0, 1], got 0"),
        (["--model.compression.up", "QSGD", "--model.compression.up.levels", "0"], "QSGD.levels (s) must be an integer >= 1, got 0"),
        (["--model.algorithm", "SCAFFOLD", "--model.compression.up", "TopK", "--model.compression.up.ratio", "0.1",
          "--model.compression.error_feedback_up", "false"], "compression.up=TopK(ratio=0.1) is biased"),
    ],
)  # fmt: skip
def test_bad_settings_stop_with_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "1", "--trainer.logger", "false", *args])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_unknown_compressor_stops_with_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.compression.up", "NoSuchCompressor"])
    assert stop.value.code == 2 and "NoSuchCompressor" in capsys.readouterr().err


def test_ddp_two_processes_send_what_one_process_sends(tmp_path):
    """SCAFFOLD (partial sums all-reduced) with QSGD uploads and random-k broadcast changes, error feedback
    on both: 2 DDP processes give the one-process model, client store (residuals included) and comm/*."""
    from tests.test_distributed import _assert_close, _train

    single, ddp = _train(tmp_path, 1, "scaffold", False, "--compress"), _train(tmp_path, 2, "scaffold", False, "--compress")
    _assert_close(single, ddp, rtol=1e-5, atol=1e-6)
    assert any("/msg:compress:" in k for k in single["store"]) and ddp["exchanges"]["summed"] == 3
    assert {k: v for k, v in single["metrics"].items() if k.startswith("comm/")} == {k: v for k, v in ddp["metrics"].items() if k.startswith("comm/")}


def test_compression_composes_with_privacy(tmp_path):
    """Under client-level DP the upload is clipped, then compressed (top-k: never beyond C), then the sum noised;
    a norm-increasing compressor or uplink error feedback is refused before training."""
    from fl_lightning.pipeline.privacy import ClientPrivacy

    module = _fit(_module(FedAvg(), Compression(up=TopK(ratio=0.1), down=Cast("bfloat16"), error_feedback_up=False)), tmp_path, rounds=1)
    assert [s.name for s in module.messages.client_stages] == ["compress"]  # no privacy in this one: the reference bytes
    private = FederatedModule(
        MLP(in_features=8, num_classes=3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=3, batch_size=8),
        privacy=ClientPrivacy(1.0, 0.5), compression=Compression(up=TopK(ratio=0.1), down=Cast("bfloat16"), error_feedback_up=False),
    )  # fmt: skip
    assert [s.name for s in private.messages.client_stages][-1] == "compress"  # after the clip
    _fit(private, tmp_path / "p", rounds=1)
    assert private.comm_totals == module.comm_totals  # the same encoded sizes
    with pytest.raises(ValueError, match=r"^compression.up=QSGD\(levels=2\) can increase an upload's norm"):
        FederatedModule(MLP(8, 3), FedAvg(), privacy=ClientPrivacy(1.0, 0.5), compression=Compression(up=QSGD(levels=2), error_feedback_up=False))
    with pytest.raises(ValueError, match=r"^compression.error_feedback_up must be false under privacy"):
        FederatedModule(MLP(8, 3), FedAvg(), privacy=ClientPrivacy(1.0, 0.5), compression=Compression(up=TopK(ratio=0.1)))
