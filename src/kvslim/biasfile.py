"""Moved to :mod:`kvslim.calibration.biasfile`; this name stays so that imports written before the move keep working."""

from .calibration.biasfile import *  # noqa: F401,F403
