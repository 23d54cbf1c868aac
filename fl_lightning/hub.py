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
