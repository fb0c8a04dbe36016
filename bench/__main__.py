"""`python -m collectives.bench` (or `python -m bench` in a checkout, `collectives-bench` once installed).

See `collectives.bench.cli` for the options and `collectives.bench.commands` for what they do. The
import is absolute so that the same file serves both spellings.
"""

import sys

from collectives.bench.commands import main

if __name__ == "__main__":
    sys.exit(main())
