"""``python -m fp4prep.cli``: the ``fp4prep`` command."""

import sys

from fp4prep.cli import main

sys.exit(main())
