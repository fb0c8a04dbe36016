"""`python -m bench`: see `bench.cli` for the options and `bench.commands` for what they do."""

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
