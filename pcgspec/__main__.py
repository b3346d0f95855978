import sys

from pcgspec.cli import main

sys.exit(main())
