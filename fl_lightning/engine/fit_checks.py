"""The settings a fit is refused for before its first round, each in one line naming the setting."""

from __future__ import annotations

from typing import Any

from fl_lightning.core.config import MAX_LOCAL_STEPS


def check_trainer(trainer: Any) -> None:
    """``trainer.max_steps`` counts rounds; ``val_check_interval`` counts rounds between evaluations."""
    if trainer.max_steps is None or trainer.max_steps < 1:
        raise ValueError(f"trainer.max_steps is the number of rounds and must be >= 1, got {trainer.max_steps}")
    interval = trainer.val_check_interval
    if interval is not None and not interval > 0:
        raise ValueError(f"trainer.val_check_interval must be > 0 (rounds between evaluations, or a fraction in (0, 1]), got {interval}")


def check_local_work(local: Any, data: Any) -> None:
    """At most ``MAX_LOCAL_STEPS`` local steps per client and round (``local.steps`` is checked when
    LocalTraining is built; epochs need the client sizes)."""
    if local.epochs is None:
        return
    steps = [data.num_local_steps(c, local.batch_size, None, local.epochs) for c in range(data.num_clients)]
    largest = max(range(len(steps)), key=steps.__getitem__)
    if steps[largest] > MAX_LOCAL_STEPS:
        raise ValueError(
            f"local.epochs={local.epochs} gives {steps[largest]} local steps per round for client {largest} "
            f"({int(data.client_sizes[largest])} samples, batch_size={local.batch_size}); "
            f"must be <= {MAX_LOCAL_STEPS} (lower local.epochs or raise local.batch_size)"
        )


def check_rounds_left(resumed_step: int | None, max_steps: int, ckpt_path: Any) -> None:
    """A resume from a checkpoint that already holds every round asked for trains nothing: refused."""
    if resumed_step is not None and resumed_step >= max_steps:
        raise ValueError(
            f"the checkpoint {ckpt_path} already holds {resumed_step} rounds, at or past "
            f"--trainer.max_steps {max_steps}: nothing to train; raise --trainer.max_steps above "
            f"{resumed_step} to continue it, or evaluate it with `fl-lightning test --ckpt_path ...`"
        )


def cohort_size(data: Any) -> int | None:
    """The clients a round selects, where the participation fixes their number (else None: checked per round)."""
    participation = getattr(data, "participation", None)
    count = getattr(participation, "count", None)
    return int(count(data.num_clients)) if callable(count) else None


def check_personal(algorithm: Any, model: Any, personal: list[str], personal_names: list[str], local: Any) -> None:
    """Personal settings that would do nothing: a ``personal`` pattern matching no trainable parameter, a
    ``local.personal_lr`` no part of the run reads, a negative ``personalize_steps``."""
    from fl_lightning.core.params import personal_names as matching

    for pattern in personal:
        if not matching(model, [pattern]):
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(f"model.personal pattern {pattern!r} matches no trainable parameter of {type(model).__name__} ({shown})")
    name = type(algorithm).__name__
    if local.personal_lr is not None and not (personal_names or getattr(algorithm, "reads_personal_lr", False)):
        raise ValueError(
            f"local.personal_lr={local.personal_lr} is read by no part of this run: {name} has no personal step size "
            "(it is Ditto's and pFedMe's gamma_v, and the step of personal tensors set by model.personal); remove it"
        )
    steps = getattr(algorithm, "personalize_steps", 0)
    if type(steps) is not int or steps < 0:
        raise ValueError(f"{name}.personalize_steps must be an integer >= 0 (evaluation's adaptation steps), got {steps!r}")
