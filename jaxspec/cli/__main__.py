"""``python -m jaxspec.cli``: the command line."""

import sys

from jaxspec.cli import main

sys.exit(main())
