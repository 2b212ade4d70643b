"""`python -m kiln.runtime.cli ...`: the same as the `kiln` command."""

import sys

from kiln.runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
