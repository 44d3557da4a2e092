"""``python -m kvps.cli``: how nodes start replicas and how tests and the chaos harness run kvps."""
import sys

from kvps.cli.main import main

sys.exit(main())
