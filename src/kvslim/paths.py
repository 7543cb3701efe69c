"""Where kvslim keeps files it can rebuild: converted models, compiled kernels.

Knows nothing about what is stored there; each user picks its own subdirectory.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """kvslim's cache directory: ``$KVSLIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvslim``, else
    ``~/.cache/kvslim`` (``~`` expanded in each). Not created here."""
    explicit = os.environ.get("KVSLIM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvslim"
