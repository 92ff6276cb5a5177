"""`python -m ostinato ...` is the `ostinato` command."""

import sys

from .cli import main

sys.exit(main())
