"""One-line errors for things loaded from the Hugging Face hub (models, tokenizers, datasets).

transformers/datasets answer a missing download with a long traceback that names neither the
setting to change nor the offline switch (and, online without a network, only after retrying
for up to a minute). ``hub_error`` turns it into one ``ValueError`` line that says which
setting names the missing thing, what to set it to, and ``HF_HUB_OFFLINE=1``; the CLI prints it
and exits with code 2.
"""

from __future__ import annotations

import os
import re


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return re.sub(r"\s+", " ", text)[:200]


def hub_error(setting: str, value: object, what: str, error: BaseException, local: str) -> ValueError:
    """``setting=value: cannot load the <what> (<reason>); set <setting> to <local> ...``."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    switch = (
        "HF_HUB_OFFLINE is set, so only local files and the cache are read"
        if offline
        else "or go online; HF_HUB_OFFLINE=1 fails at once instead of retrying"
    )
    return ValueError(
        f"{setting}={value!r}: cannot load the {what} ({_first_line(error)}); set {setting} to {local}, {switch}"
    )


def quiet_hub() -> None:
    """No transformers load report ("score.weight MISSING": the new classification head, which LoRA
    trains) and no download or dataset progress bars; errors still show. ``FL_LIGHTNING_VERBOSE=1``
    keeps everything. Called before a model, tokenizer or dataset is loaded."""
    if os.environ.get("FL_LIGHTNING_VERBOSE"):
        return
    import logging
    import sys
    import warnings

    # peft asks transformers for a renamed attribute: a deprecation for the libraries' authors, not the user
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)

    for name, value in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                        ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"), ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")):  # fmt: skip
        os.environ.setdefault(name, value)  # read when the library is first imported
    for name in ("transformers", "datasets", "huggingface_hub", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # already configured (Lightning's torchmetrics imports it)
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.utils.logging.set_verbosity_error()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
