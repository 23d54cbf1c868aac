"""The ``fl-lightning`` command.

``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI subcommands over FederatedModule
and any FederatedDataModule (fl_lightning/run/cli_app.py); ``compare`` runs a sweep
(fl_lightning/experiments/compare.py), ``montecarlo`` a Monte Carlo experiment (fl_lightning/experiments/montecarlo.py)
and ``partition`` draws a config's partition (fl_lightning/experiments/partition_plot.py).
Lightning is imported only by the subcommand that needs it: ``fl-lightning --help`` and
``--version`` answer at once.
"""

from __future__ import annotations

import os
import pickle
import sys

from fl_lightning.core.errors import KNOWN_ERRORS, RunInterrupted
from fl_lightning.core.errors import essential as _essential

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
OTHER_SUBCOMMANDS = ("compare", "tune", "montecarlo", "partition", "fixture", "lora-fixture", "configs")

HELP = """\
usage: fl-lightning [-h] [--version] [--import MODULES] {fit,validate,test,predict,compare,tune,montecarlo,partition,fixture,lora-fixture,configs} ...

Federated learning on PyTorch Lightning: one training step = one federated round.

subcommands:
  fit         train: fl-lightning fit --config quickstart [--trainer.max_steps ROUNDS]
  validate    evaluate the global model on the validation set (--ckpt_path CKPT)
  test        evaluate the global model on the test set (--ckpt_path CKPT)
  predict     run the global model on the predict set (--ckpt_path CKPT)
  compare     run every run x seed of a sweep file, then plots and tables:
              fl-lightning compare --config configs/compare_quickstart.yaml --out runs/compare_quickstart
  tune        tune each method of a study file on Optuna with the same budget, then test the best on fresh seeds:
              fl-lightning tune --config configs/tune_digits_study.yaml --out runs/tune_digits
  montecarlo  many seeds of one config with a confidence band (e.g. configs/svrg_least_squares_mc.yaml)
  partition   draw the label distribution of every client of a config's partition:
              fl-lightning partition --config configs/quickstart.yaml --out partition.png
  fixture     write a tiny offline copy of a hub vision dataset and print its dataset_args:
              fl-lightning fixture cifar10 --out runs/fx
  lora-fixture  write the tiny offline GPT-2 + GLUE fixture of docs/lora.md and print its settings:
              fl-lightning lora-fixture runs/lora_fx
              (--instruction: the instruction-tuning fixture of docs/instruction_tuning.md)
  configs     list the bundled configs (fl-lightning fit --config quickstart runs one by name);
              fl-lightning configs --copy quickstart my_configs/ copies one to edit

options:
  -h, --help  show this help message and exit
  --version   show the version and exit
  --import MODULES
              import your own modules (comma-separated) before the config is parsed, so that the
              data sources, algorithms and models they register or define can be named in it;
              found on PYTHONPATH or in the current directory (also accepted after the subcommand)

Each subcommand has its own help, e.g. `fl-lightning fit --help` (the project's settings and their
ranges; `fl-lightning fit --help-all`: every setting, Lightning's included), `fl-lightning compare --help`;
the arguments of one class: `fl-lightning fit --model.algorithm.help FedProx`.
Every setting of a config with its default: `fl-lightning fit --config FILE --print_config`.
A bad setting ends with one line naming it (one line for each bad setting, exit code 2);
--debug (or FL_LIGHTNING_TRACEBACK=1) shows the traceback.
"""


def build_cli(args: list[str] | None = None, run: bool = True, exit_on_error: bool = True):
    """The LightningCLI object (``run=False`` only parses and instantiates, for validation and tests).

    ``exit_on_error=False`` raises jsonargparse's ArgumentError on a bad setting instead of exiting.
    """
    from fl_lightning.run.cli_app import build

    return build(args, run=run, exit_on_error=exit_on_error)


def _bundled_config_names(argv: list[str]) -> list[str]:
    """``--config NAME`` naming no file but a bundled config (``quickstart``) becomes that config's path."""
    from fl_lightning.run.bundled_configs import resolve

    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _existing_config(resolve(out[i + 1]))
        elif arg.startswith("--config="):
            out[i] = "--config=" + _existing_config(resolve(arg.split("=", 1)[1]))
    return out


def _existing_config(value: str) -> str:
    """A ``--config`` that is neither a file, a bundled config nor inline YAML is one line at once
    (before Lightning is imported), with the nearest bundled name."""
    import difflib
    from pathlib import Path

    if Path(value).exists() or any(c in value for c in "{}:\n"):
        return value
    from fl_lightning.run.bundled_configs import names

    near = difflib.get_close_matches(Path(value).stem, names(), n=1)
    hint = f"; did you mean {near[0]}?" if near else "; `fl-lightning configs` lists the bundled ones"
    raise ValueError(f"--config {value}: no such file, and no bundled config of that name{hint}")


def _lightning_subcommand(argv: list[str], stored: bool) -> None:
    """``fit``/``validate``/``test``/``predict``; a help or ``--print_config`` answer seen before is
    printed from the store without importing Lightning (fl_lightning/run/answer_cache.py)."""
    from contextlib import nullcontext

    from fl_lightning.commands.settings_help import page, wants_page
    from fl_lightning.run import answer_cache

    if wants_page(argv):  # the project's settings at once; Lightning's full list is --help-all
        sys.stdout.write(page(argv[0]))
        raise SystemExit(0)  # as the parser's help
    if not os.environ.get("FL_LIGHTNING_TRACEBACK"):
        _check_settings(argv, user_modules=not stored)
    name = answer_cache.request_key(argv) if stored and answer_cache.is_read_only(argv) else None
    if name is not None and (answer := answer_cache.lookup(name)) is not None:
        sys.stdout.write(answer)
        return
    saved, sys.argv = sys.argv, sys.argv[:1]  # the arguments are passed explicitly
    try:
        with answer_cache.recording(name) if name is not None else nullcontext():
            build_cli(["--help" if a == "--help-all" else a for a in argv])
    finally:
        sys.argv = saved


def _check_settings(argv: list[str], user_modules: bool = False) -> None:
    """Every bad setting of the command, one line each, then exit code 2, before Lightning is imported
    (fl_lightning/run/setting_check.py): an unknown key or class name when an earlier command stored the
    parser's schema (not with ``--import``ed user modules), a value out of its documented range always
    (not for help or --print_config); everything else is the parser's to judge."""
    from fl_lightning.run import answer_cache
    from fl_lightning.run.config_files import expand_bases
    from fl_lightning.run.setting_check import check_all, load_schema

    schema = None if user_modules else load_schema(argv[0])
    lines = check_all(expand_bases(list(argv)), schema, values=not answer_cache.is_read_only(argv), user_modules=user_modules)
    if lines:
        sys.stderr.write("".join(f"fl-lightning: error: {line}\n" for line in lines))
        raise SystemExit(2)


JSONARGPARSE_WORDING = ("Does not validate against any", "Expected a <class 'NoneType'>", "Subtypes:", "Errors:", "Given value")


def _plain(message: str) -> str:
    """A class's refusal without the parser's union bookkeeping around it (a class argument refused while a
    class setting of a class setting, e.g. ``--model.compression.up.ratio``, is instantiated)."""
    parts = [p.strip() for p in message.replace("\n", "; ").split("; ")]
    kept = [p for p in parts if p and not p.lstrip("- ").startswith(JSONARGPARSE_WORDING)]
    # a union's other alternatives (``execution``: a name or an executor) are not what the class refused
    refused = [p for p in kept if not p.lstrip("- ").startswith("Expected a <class '")]
    return "; ".join(refused or kept) or message


def _version() -> str:
    from fl_lightning import __version__

    return f"fl-lightning {__version__}"


def main(args: list[str] | None = None) -> None:
    """Console entry point: a bad setting ends with one line naming it (exit code 2).

    Set ``FL_LIGHTNING_TRACEBACK=1`` to see the full traceback instead.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if "--debug" in argv and not os.environ.get("FL_LIGHTNING_TRACEBACK"):
        # For the parsers' errors too (fl_lightning/run/config_errors.py), for this call only: an in-process
        # caller's later calls keep their one-line errors.
        os.environ["FL_LIGHTNING_TRACEBACK"] = "1"
        try:
            return main([a for a in argv if a != "--debug"])
        finally:
            del os.environ["FL_LIGHTNING_TRACEBACK"]
    debug = bool(os.environ.get("FL_LIGHTNING_TRACEBACK"))
    argv = [a for a in argv if a != "--debug"]
    try:
        from fl_lightning.commands.user_modules import import_user_modules, take_import_option

        argv, user_modules = take_import_option(argv)  # before any config is parsed (fl_lightning/commands/user_modules.py)
        import_user_modules(user_modules)
    except ValueError as error:
        if debug:
            raise
        print(f"fl-lightning: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP, end="")
        return
    if argv[0] == "--version":
        print(_version())
        return
    try:
        argv = _bundled_config_names(argv)
        if argv[0] == "configs":
            from fl_lightning.run.bundled_configs import main as configs_main

            configs_main(argv[1:])
        elif argv[0] == "lora-fixture":
            from fl_lightning.commands.lora_fixture import main as lora_fixture_main

            lora_fixture_main(argv[1:])
        elif argv[0] == "compare":  # not a LightningCLI subcommand: runs many fits, see fl_lightning/experiments/compare.py
            from fl_lightning.experiments.compare import main as compare_main

            compare_main(argv[1:])
        elif argv[0] == "tune":  # many fits on Optuna, see fl_lightning/experiments/tune.py
            from fl_lightning.experiments.tune import main as tune_main

            tune_main(argv[1:])
        elif argv[0] == "partition":
            from fl_lightning.experiments.partition_plot import main as partition_main

            partition_main(argv[1:])
        elif argv[0] == "fixture":
            from fl_lightning.datamodules.fixtures import main as fixture_main

            fixture_main(argv[1:])
        elif argv[0] == "montecarlo":
            from fl_lightning.experiments.montecarlo import main as montecarlo_main

            montecarlo_main(argv[1:])
        else:
            if argv[0] not in LIGHTNING_SUBCOMMANDS and not argv[0].startswith("-"):
                raise ValueError(
                    f"unknown subcommand {argv[0]!r}; allowed: {', '.join((*LIGHTNING_SUBCOMMANDS, *OTHER_SUBCOMMANDS))}"
                )
            _lightning_subcommand(argv, stored=not user_modules)
    except pickle.UnpicklingError as error:  # torch.load(weights_only=True) refused an object in the checkpoint
        if debug:
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"fl-lightning: error: the checkpoint holds objects a weights-only load refuses ({first}); "
              "pass --weights_only false only for a checkpoint you trust", file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    except KNOWN_ERRORS as error:  # a bad setting, divergence, failing clients, a bad checkpoint or store
        if debug:
            raise
        print(f"fl-lightning: error: {_plain(_essential(str(error)))}", file=sys.stderr)
        raise SystemExit(error.exit_code if isinstance(error, RunInterrupted) else 2) from None  # 128 + the signal
    except Exception as error:  # Lightning's refused settings, a full or read-only folder, memory
        from fl_lightning.core.errors import explain

        line = None if debug else explain(error)
        if line is None:
            raise
        print(f"fl-lightning: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
