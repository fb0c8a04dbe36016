"""`python -m collectives.selection show|clear [--dir DIR]`: list or delete the tuning cache's files.

The command lives here, not in `collectives.selection.tuning`, because importing the package
imports that module already: run with -m, it would execute as a second copy of itself (which
Python warns about on every run).
"""

import sys

from collectives.selection.tuning import main

if __name__ == "__main__":
    sys.exit(main())
