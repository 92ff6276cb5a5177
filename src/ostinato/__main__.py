"""`python -m ostinato ...` is the `ostinato` command."""

import sys

from ostinato.cli import main

sys.exit(main())
