"""``python -m stepgraph`` runs the command line."""

import sys

from stepgraph.cli import main

sys.exit(main())
