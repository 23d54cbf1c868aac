"""Kept for old commands: the fixture builders live in ``datamodules/fixtures.py``
(``fl-lightning fixture DATASET --out DIR``)."""

from datamodules.fixtures import HUB_COLUMNS, png_bytes, write_fixture  # noqa: F401

if __name__ == "__main__":  # python -m tests.vision_fixture OUTDIR DATASET [N_TRAIN N_TEST]
    import json
    import sys
    from pathlib import Path

    out, name = Path(sys.argv[1]), sys.argv[2]
    sizes = [int(a) for a in sys.argv[3:5]] or [200, 100]
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"data_files": write_fixture(out, name, *sizes), "cache_dir": str(out / "cache")}))
