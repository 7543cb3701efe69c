"""Moved to :mod:`kvslim.calibration.meancenter`; this name stays so that imports written before the move keep working."""

from .calibration.meancenter import *  # noqa: F401,F403
