"""The ``tandem`` command's entry point (and ``python -m tandem.server``).

It imports the command only inside its ``try``, so a Ctrl-C while torch and the rest
load still ends with status 130 and one line instead of a traceback.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from tandem.server.cli import main as command

        return command()
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
