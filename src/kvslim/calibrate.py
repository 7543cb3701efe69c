"""Moved to :mod:`kvslim.calibration.calibrate`; this name stays so that imports written before the move keep working."""

from .calibration.calibrate import *  # noqa: F401,F403
