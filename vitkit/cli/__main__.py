"""``python -m vitkit.cli ARGS``: the ``vitkit`` command."""

import sys

from vitkit.cli import main

sys.exit(main())
