"""``python -m tandem.scheduler``: offline generation (see ``tandem.scheduler.engine.cli``)."""

import sys

from tandem.scheduler.engine.cli import main

sys.exit(main())
