"""``python -m tangram_sglang.calibrate``: see :mod:`tangram_sglang.calibrate.cli`."""

import sys

from tangram_sglang.calibrate.cli import main

sys.exit(main())
