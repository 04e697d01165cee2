"""``python -m tandem.futuremap``: the FutureMap overlap-loop demo."""

import sys

from tandem.futuremap.demo import main

sys.exit(main())
