"""How long the C kernels' own workers spin for the next call before they sleep: the setting's name, range and checks.

Read by :mod:`kvslim.kernels.clib` when the library loads and by :func:`kvslim.threads.prepare` (which refuses a bad
value at a command's start); imports nothing (the CLI calls it before torch loads).
"""

from __future__ import annotations

from collections.abc import Mapping

#: microseconds (csrc/kvslim_linear.c's LIN_SPIN_NS by default; :func:`kvslim.kernels.clib.pool_spin_us`); 0 sleeps
#: at once
ENV_SPIN = "KVSLIM_POOL_SPIN_US"
SPIN_MAX_US = 100_000


def check_spin(us) -> int:
    """``us`` as the workers' spin in microseconds; ValueError in one line unless a whole number 0-SPIN_MAX_US."""
    if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= SPIN_MAX_US:
        raise ValueError(
            f"the workers' spin must be a whole number of microseconds 0-{SPIN_MAX_US}, got {us!r}"
        )
    return us


def spin_from_env(env: Mapping[str, str]) -> int | None:
    """``$KVSLIM_POOL_SPIN_US`` in microseconds (None: unset or empty); ValueError in one line for a bad value."""
    raw = (env.get(ENV_SPIN) or "").strip()
    if not raw:
        return None
    try:
        return check_spin(int(raw))
    except ValueError:
        raise ValueError(
            f"{ENV_SPIN}={env.get(ENV_SPIN)} must be a whole number of microseconds 0-{SPIN_MAX_US}"
        ) from None
