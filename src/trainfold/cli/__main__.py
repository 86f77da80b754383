"""``python -m trainfold.cli``: the command line, :mod:`trainfold.cli.main`."""

import sys

from trainfold.cli.main import command

if __name__ == "__main__":
    sys.exit(command())
