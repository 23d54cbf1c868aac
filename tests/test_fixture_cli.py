"""`fl-lightning fixture`: the offline vision fixtures are a command, not a module under tests/."""

import json

from fl_lightning.commands.cli import main


def test_fixture_command_writes_hub_schema_parquet_and_prints_dataset_args(tmp_path, capsys):
    import datasets

    main(["fixture", "mnist", "--out", str(tmp_path / "fx"), "--train", "8", "--test", "4"])
    args = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(args) == {"data_files", "cache_dir"}
    train = datasets.load_dataset("parquet", data_files=args["data_files"], cache_dir=args["cache_dir"])["train"]
    assert train.num_rows == 8 and set(train.column_names) == {"image", "label"}
