from jaxspec.cli import entry

entry()
