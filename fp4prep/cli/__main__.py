import sys

from fp4prep.cli import main

sys.exit(main())
