"""``python -m tandem.scheduler``: offline generation (see ``tandem.scheduler.cli``)."""

import sys

from tandem.scheduler.cli import main

sys.exit(main())
