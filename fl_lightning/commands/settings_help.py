"""The short ``--help`` page of ``fl-lightning fit|validate|test|predict``: the project's own settings.

Printed without building the parser (which imports Lightning), so it answers at once. The full list,
Lightning's trainer settings included, is ``--help-all``; one class's arguments ``--*.help CLASS``
(e.g. ``--model.compression.up.help TopK``). The ranges are those of fl_lightning/run/setting_ranges.py
and docs/settings.md.
"""

from __future__ import annotations

PURPOSE = {
    "fit": "Train: one training step is one federated round.",
    "validate": "Evaluate the global model of a checkpoint (--ckpt_path) on the validation set.",
    "test": "Evaluate the global model of a checkpoint (--ckpt_path) on the test set.",
    "predict": "Run the global model of a checkpoint (--ckpt_path) on the predict set.",
}

PAGE = """\
usage: fl-lightning {subcommand} [--config FILE] [--SETTING VALUE ...] [--help-all]

{purpose}
Settings come from config files (later files override earlier ones; `base:` in a file chains)
and from the command line (`--model.local.lr 0.02`). This page lists the project's own settings
and their allowed values; `fl-lightning {subcommand} --help-all` lists every setting, Lightning's
trainer included.

run:
  --config FILE                    a config file, or a bundled config's name (fl-lightning configs)
  --seed_everything N              seeds the model, the partition, the sampling and every client
  --ckpt_path CKPT                 a checkpoint to resume or evaluate (last: the newest of the run)
  --threads N|auto                 torch intra-op threads (default auto)
  --print_config                   every setting of the config with its default, then exit

algorithm (model.algorithm; its arguments: --model.algorithm.help NAME):
  --model.algorithm NAME           FedAvg (default), FedProx, SCAFFOLD, FedAdam, FedDyn, ...
  --model.algorithm.global_lr X    server learning rate, > 0
  --model.algorithm.mu X           e.g. FedProx's proximal weight, >= 0

local training (model.local):
  --model.local.lr X               > 0, finite
  --model.local.steps K            local steps a round, 1..100000 (or epochs: exactly one of them)
  --model.local.epochs E           passes over the client's data a round, >= 1
  --model.local.batch_size B       >= 1, or null (the whole local set)
  --model.local.weight_decay X     >= 0
  --model.local.lr_decay X         (0, 1]; also lr_schedule (exponential, inv_sqrt, cosine, step)
  --model.local.personal_lr X      > 0, or null (= lr)

rounds and evaluation (trainer):
  --trainer.max_steps R            rounds, >= 1
  --trainer.val_check_interval N   rounds between evaluations, > 0 (a float in (0, 1]: a fraction)
  --trainer.default_root_dir DIR   the run's folder (version_N/: metrics.csv, config.yaml, ...)

data (data.init_args; --data NAME picks the module, e.g. VisionDataModule):
  --data.init_args.dataset NAME            digits, synthetic, cifar10, ... (a registered source)
  --data.init_args.num_clients N           >= 1
  --data.init_args.partition NAME          IID, Dirichlet (alpha > 0), Shards, QuantitySkew, ...
  --data.init_args.participation NAME      UniformSampling (clients_per_round: >= 1, or a
                                           fraction in (0, 1]) or BernoulliParticipation
  --data.init_args.holdout_fraction F      [0, 1): each client's held-out share
  --data.init_args.val_fraction F          [0, 1 - holdout_fraction): the pooled validation split
  --data.init_args.new_client_fraction F   [0, 1): clients that never train (needs a holdout)
  --data.init_args.eval_batch_size N       >= 1 (seed: an integer >= 0, default --seed_everything)

compression (docs/compression.md):
  --model.compression.up NAME      TopK or RandomK (ratio, k), QSGD (levels), ScaledSign, Int8, Cast
  --model.compression.down NAME    the downlink one (arguments: --model.compression.up.ratio X)
  --model.compression.error_feedback_up, .error_feedback_down, .flatten   true|false

privacy (docs/privacy.md):
  --model.privacy.clip_norm C          client-level DP: the clip norm, > 0
  --model.privacy.noise_multiplier S   >= 0
  --model.privacy.delta D              (0, 1); .target_epsilon E: > 0, or null (no budget)
  --model.record_privacy.*             record-level DP-SGD: clip_norm, noise_multiplier, delta alike
  --model.secure_aggregation.*         SecAgg(+): bits, clip, neighbours; distributed DP: noise

robust aggregation (docs/robustness.md):
  --model.robust.rule NAME         median, trimmed_mean, (multi_)krum, bulyan, geometric_median, ...
  --model.robust.f F               attackers per round, >= 0 (or --model.robust.fraction in [0, 1))

attacks (docs/robustness.md):
  --model.attack.fraction F        [0, 1): the malicious clients, drawn from the seed
  --model.attack.data NAME         LabelFlip or Backdoor (target, fraction, patch); null: none
  --model.attack.upload NAME       ModelReplacement, SignFlip, GaussianUpload, ALIE, IPM, ...

more (docs/personalization.md, time.md, lora.md, architecture.md):
  --model.personal PATTERNS        globs kept per client (FedAvgP, FedSim, FedAlt, ScaffoldP)
  --model.clock.speed_sigma X      simulated time: speeds, bandwidth, trace, availability, deadline
  --model.asynchronous.mode NAME   fedbuff or fedasync (needs model.clock): a step = a server update
  --model.lora_aggregation NAME    factors, stacked, exact_residual, svd, zero_pad or share_a
  --model.stages '[{{class_path: mine.MyStage}}]'  your own round stages (with --import mine)

execution:
  --model.execution NAME           sequential (default), batched or auto (docs/performance.md)

A bad setting stops the command before anything runs: one line for each bad setting, naming it
and its allowed range (exit code 2). One class's arguments: --model.algorithm.help FedProx,
--model.compression.up.help TopK (any --*.help CLASS). Every setting and range: docs/settings.md.
"""


def page(subcommand: str) -> str:
    return PAGE.format(subcommand=subcommand, purpose=PURPOSE.get(subcommand, PURPOSE["fit"]))


def wants_page(argv: list[str]) -> bool:
    """``fit --help`` (or ``-h``): the short page; ``--help-all`` and ``--*.help CLASS`` are the parser's."""
    return any(a in ("-h", "--help") for a in argv[1:])
