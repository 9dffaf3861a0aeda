import sys

from tangram_sglang.eval.cli import main

sys.exit(main())
