"""``python -m kvslim.cli``: the ``kvslim`` console script, also as ``torchrun -m kvslim.cli ...``."""

import sys

from . import main

sys.exit(main())
