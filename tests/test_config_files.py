"""Fit configs composed from a base (``base:``), resolved exactly like LightningCLI's repeated ``--config``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fl_lightning.commands.cli import build_cli
from fl_lightning.run.config_files import expand_bases

ROOT = Path(__file__).resolve().parents[1]


def _resolved(*args: str) -> dict:
    parser_cli = build_cli(list(args), run=False)
    config = yaml.safe_load(parser_cli.parser.dump(parser_cli.config, skip_none=False))
    for key in ("config", "base"):
        config.pop(key, None)
    return config


def _flat(tree: dict | list, prefix: str = "") -> dict:
    out = {}
    for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        if isinstance(value, (dict, list)) and value and not (isinstance(value, list) and not isinstance(value[0], dict)):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Hub-model overlays (fedit_*, lora_*) need a downloaded GPT-2 to build; tests/test_lora_cli.py, tests/test_instruction_tuning.py
# and tests/test_lora_aggregation_cli.py compose and run them on offline fixtures.
OVERLAYS = sorted(
    p.name for p in (ROOT / "configs").glob("*.yaml")
    if "base" in (yaml.safe_load(p.read_text()) or {}) and not {"runs", "methods"} & set(yaml.safe_load(p.read_text()))
    and not p.name.startswith(("fedit_", "lora_"))
)  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_composed_config_is_its_base_with_the_overlays_keys_replaced(overlay):
    path = ROOT / "configs" / overlay
    raw = yaml.safe_load(path.read_text())
    base = ROOT / "configs" / raw.pop("base")
    composed, inherited, own = _flat(_resolved("--config", str(path))), _flat(_resolved("--config", str(base))), _flat(raw)
    replaced = {k.rsplit(".class_path", 1)[0] for k in own if k.endswith("class_path")}  # a new class: new init_args
    for key, value in composed.items():
        if key in own:
            assert value == own[key], key
        elif key not in inherited:  # a section the base leaves unset (null): the overlay set a sibling
            sibling = any(k.startswith(key.rsplit(".", 1)[0] + ".") for k in own)
            assert sibling or any(key.startswith(prefix + ".") for prefix in replaced), key  # or a new class's default
        elif not any(key.startswith(prefix + ".") for prefix in replaced):
            assert value == inherited[key], key
    assert len(OVERLAYS) >= 13


def test_base_chains_loops_and_missing_bases(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\nmodel: {local: {lr: 0.02}}\n")
    (tmp_path / "b.yaml").write_text(f"base: {ROOT / 'configs' / 'quickstart.yaml'}\nmodel: {{local: {{steps: 3}}}}\n")
    args = expand_bases(["--config", str(tmp_path / "a.yaml")])
    assert args == ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(tmp_path / "b.yaml"),
                    "--config", str(tmp_path / "a.yaml")]  # fmt: skip
    local = _resolved("--config", str(tmp_path / "a.yaml"))["model"]["local"]
    assert (local["lr"], local["steps"], local["batch_size"]) == (0.02, 3, 20)  # a, b, quickstart
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ValueError, match="loop"):
        expand_bases(["--config", str(tmp_path / "loop.yaml")])
    (tmp_path / "orphan.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ValueError, match="'nowhere.yaml' not found"):
        expand_bases(["--config", str(tmp_path / "orphan.yaml")])


def test_the_run_is_named_after_the_users_file_not_its_base():
    cli = build_cli(["--config", str(ROOT / "configs" / "fedprox_digits.yaml"), "--trainer.max_steps", "1"], run=False)
    assert cli._experiment(cli.config) == "fedprox_digits"
