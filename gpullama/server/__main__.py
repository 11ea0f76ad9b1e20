"""``python -m gpullama.server`` runs ``gpullama-serve``."""

import sys

from .cli import main

sys.exit(main())
