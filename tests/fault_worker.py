"""``python tests/fault_worker.py ARGS``: ``jaxspec ARGS`` with a fault injected in one process's decoding loop.

``$JAXSPEC_TEST_FAULT`` = ``P:K`` makes the K-th decoding step of process P (its ``--process-id``)
raise, as a device error or a bug would: tests/test_distributed.py checks that every process of
the run then ends with a clear error line instead of hanging in the next collective.
"""

from __future__ import annotations

import os
import sys

from jaxspec.cli import main
from jaxspec.engine.core import EngineCore


def _inject() -> None:
    process, step = (int(x) for x in os.environ["JAXSPEC_TEST_FAULT"].split(":"))
    argv = sys.argv[1:]
    if int(argv[argv.index("--process-id") + 1]) != process:
        return
    decode = EngineCore._decode
    calls = [0]

    def failing(self: EngineCore) -> None:
        calls[0] += 1
        if calls[0] == step:
            raise RuntimeError(f"injected fault in decoding step {step}")
        decode(self)

    EngineCore._decode = failing


if __name__ == "__main__":
    _inject()
    sys.exit(main(sys.argv[1:]))
