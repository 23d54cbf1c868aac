"""The round-stage contract: the docs' composition table is the declarations' table, each declared
conflict refuses in one line before training, stages run in their declared order, and the engine's
module stays thin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.adversary import Attack, LabelFlip
from fl_lightning.compression import Compression, RandomK
from fl_lightning.models import MLP
from fl_lightning.pipeline.privacy import ClientPrivacy
from fl_lightning.pipeline.record_privacy import RecordPrivacy
from fl_lightning.robust import Robust
from fl_lightning.rounds import SHAPE, RoundStage
from fl_lightning.rounds.build import shipped_stages
from fl_lightning.rounds.composition import check_composition, composition_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_generated_from_the_declarations():
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"<!-- composition table:[^\n]*-->\n(.*?)\n<!-- end of composition table -->", text, re.S)
    assert found and found.group(1) == composition_table(*shipped_stages())


def _module(**settings):
    return FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), local=LocalTraining(steps=2, batch_size=8), **settings)


PRIVACY = dict(clip_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize("settings, line", [
    (dict(robust=Robust("median"), privacy=ClientPrivacy(**PRIVACY)), "robust.rule=median with privacy"),
    (dict(compression=Compression(up=RandomK(ratio=0.5, unbiased=True)), privacy=ClientPrivacy(**PRIVACY)), "compression.up=RandomK"),
    (dict(attack=Attack(0.2, data=LabelFlip()), record_privacy=RecordPrivacy(clip_norm=1.0, noise_multiplier=1.0)), "attack.data cannot poison"),
])  # fmt: skip
def test_every_declared_conflict_refuses_when_the_module_is_built(settings, line):
    with pytest.raises(ValueError, match=re.escape(line)) as error:
        _module(**settings)
    assert "\n" not in str(error.value)


def test_every_shipped_stage_declares_a_setting_and_a_unique_name():
    stages, drivers = shipped_stages()
    names = [s.name for s in stages]
    assert len(set(names)) == len(names)
    declared = {other for cls in [*stages, *drivers] for other in cls.conflicts}
    assert declared <= set(names), declared - set(names)


class Named(RoundStage):
    def __init__(self, name, order, calls):
        self.name, self.order, self.calls = name, order, calls

    def shape_cohort(self, round, cohort):
        self.calls.append(self.name)


def test_two_stages_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two round stages are named 'x'"):
        check_composition([Named("x", 1, []), Named("x", 2, [])])


def test_stages_run_in_their_declared_order_around_the_shipped_ones(tmp_path):
    from tests.conftest import tiny_datamodule, tiny_trainer

    calls = []
    module = _module(stages=[Named("late", SHAPE + 50, calls), Named("early", SHAPE - 15, calls)])
    names = [s.name for s in module.rounds.stages]
    assert names.index("early") < names.index("faults") < names.index("late")
    tiny_trainer(tmp_path, 2).fit(module, datamodule=tiny_datamodule())
    assert calls == ["early", "late"] * 2


def test_the_engine_module_is_thin():
    source = (ROOT / "fl_lightning" / "engine" / "module.py").read_text()
    assert len(source.splitlines()) <= 300
    mechanisms = ("self.clock", "self.robust", "self.attack", "self.lora", "self.messages", "self.record_privacy", "self.asynchronous")
    body = source[source.index("def training_step"):]
    assert not [m for m in mechanisms if m in body]
