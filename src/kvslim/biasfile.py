"""Moved to :mod:`kvslim.calibration.biasfile` (and the channel order to :mod:`kvslim.calibration.channelorder`);
this name stays so that imports written before the move keep working."""

from .calibration.biasfile import *  # noqa: F401,F403
from .calibration.channelorder import *  # noqa: F401,F403
