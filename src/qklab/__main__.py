"""``python -m qklab ...``: the command line (also what ``torchrun -m qklab train ...`` starts on every rank)."""

import sys

from qklab.cli import main

sys.exit(main())
