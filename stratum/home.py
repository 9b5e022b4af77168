"""Where Stratum keeps what it downloads, converts and measures: $STRATUM_HOME (default ~/.cache/stratum)."""

from __future__ import annotations

import os
from pathlib import Path


def stratum_home() -> Path:
    return Path(os.environ.get("STRATUM_HOME") or Path.home() / ".cache" / "stratum")
