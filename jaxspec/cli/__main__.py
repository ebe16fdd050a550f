"""``python -m jaxspec.cli``: the command line."""

from jaxspec.cli import entry

entry()
