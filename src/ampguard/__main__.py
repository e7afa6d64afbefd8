"""``python -m ampguard`` runs the CLI."""

import sys

from ampguard.cli import main

sys.exit(main())
