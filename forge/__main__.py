"""``python -m forge``."""

import sys

from forge.cli import main

sys.exit(main())
