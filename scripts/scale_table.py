"""Per-device memory and per-iteration communication of the paper's distributed settings (docs/scale.md).

Computed from the model configs and jaxspec's own parameter tree (``models.transformer``:
shapes from ``param_shapes``, logical axes from ``logical_axes``), so the table follows
the code: a parameter with a tensor-sharded logical axis is split over ``tensor`` when the
size divides (else replicated, as the sharding rules fall back), stacked layers are split
over ``pipe``, and the rest is replicated on every device.

    .venv/bin/python scripts/scale_table.py                   # prints the markdown
    .venv/bin/python scripts/scale_table.py --output docs/scale.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ModelConfig  # noqa: E402
from models.transformer import logical_axes, param_shapes  # noqa: E402

BYTES = 2  # float16, as the paper serves its LLMs
GB = 1e9
A10_GB = 24.0  # the paper's GPUs: NVIDIA A10 24GB, 4 per node, nodes on 100 Gbps Ethernet
LINK_GBPS = 100.0
TENSOR_AXES = ("heads", "kv_heads", "mlp", "vocab")  # logical axes the rules map onto the tensor mesh axis
PAPER_TREE = 21  # tokens of the expansion <1,1,3,1,1,1,1,1> (root + 20 drafted): the paper's tree
TOKENS = (1, PAPER_TREE, 64)  # tokens per request per iteration: incremental, paper tree, a 64-node budget
BATCHES = (1, 16)
CONTEXT = 2048  # the three LLMs' context; the paper's requests (prompt + 128 new tokens) stay within it

# Published hyper-parameters (the Hugging Face configs the paper loads: huggyllama/llama-7b,
# huggyllama/llama-65b, facebook/opt-30b; JackFram/llama-68m for the SSM).
MODELS: dict[str, ModelConfig] = {
    "LLaMA-7B": ModelConfig("llama", 32000, 4096, 11008, 32, 32, 32, 128),
    "OPT-30B": ModelConfig("opt", 50272, 7168, 28672, 48, 56, 56, 128, tie_word_embeddings=True,
                           attention_bias=True, activation="relu", word_embed_proj_dim=7168),
    "LLaMA-65B": ModelConfig("llama", 32000, 8192, 22016, 80, 64, 64, 128),
    "LLaMA-68M (SSM)": ModelConfig("llama", 32000, 768, 3072, 2, 12, 12, 64),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One deployment: a model on a (data, tensor, pipe) mesh, with what the paper says about it."""

    model: str
    tensor: int
    pipe: int
    data: int = 1
    paper: str = ""
    deployed: bool = True  # False: a setting the paper rules out (memory table only)

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipe

    @property
    def mesh(self) -> str:
        return f"data={self.data},tensor={self.tensor},pipe={self.pipe}"


SETTINGS = (
    Setting("LLaMA-7B", 1, 1, paper="1 A10, fp16; 1.5-2.5x over incremental (single node)"),
    Setting("OPT-30B", 4, 1, paper="4 A10 (1 node), TP=4, fp16; 1.5-2.5x (single node)"),
    Setting("LLaMA-65B", 4, 1, paper="\"does not fit on four GPUs on a single node\"", deployed=False),
    Setting("LLaMA-65B", 4, 2, paper="8 A10 (2 nodes), TP=4 in a node x PP=2 across nodes; 2.4-2.8x"),
    Setting("LLaMA-68M (SSM)", 1, 1, data=4, paper="SSMs data-parallel, one copy per GPU (Figure 6)"),
)


def weight_bytes(cfg: ModelConfig, tensor: int, pipe: int) -> tuple[int, int]:
    """(total parameter bytes, bytes on the fullest device) of ``cfg`` in float16 on a tensor x pipe mesh."""
    shapes = jax.tree_util.tree_leaves(param_shapes(cfg, jnp.float16))
    specs = jax.tree_util.tree_leaves(logical_axes(cfg), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    if len(shapes) != len(specs):
        raise ValueError("parameter and logical-axis trees differ")
    total = per_device = 0
    for shape, spec in zip(shapes, specs):
        size = math.prod(shape.shape) * BYTES
        total += size
        dims = dict(zip(spec, shape.shape))
        split = next((tensor for name in TENSOR_AXES if dims.get(name, 1) % tensor == 0 and name in dims), 1)
        if "layers" in dims and dims["layers"] % pipe == 0:
            split *= pipe
        per_device += -(-size // split)
    return total, per_device


def kv_bytes_per_token(cfg: ModelConfig, tensor: int, pipe: int) -> int:
    """Key + value bytes one token adds to one device's cache: 2 x (L / pipe) x (K / tensor) x H x 2."""
    kv_heads = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
    return 2 * (cfg.num_layers // pipe) * kv_heads * cfg.head_dim * BYTES


def tensor_bytes(cfg: ModelConfig, s: Setting, tokens: int, batch: int) -> tuple[int, int, int]:
    """(all-reduces per iteration on one stage, all-reduce bytes one device sends, logits all-gather bytes).

    Megatron layout: one all-reduce of the [B, T, D] activations after attention and one
    after the MLP in each of the stage's layers, one after the vocabulary-sharded embedding;
    a ring all-reduce sends 2 (tensor - 1) / tensor of the payload per device. The
    vocabulary-sharded head's [B, T, V] logits are all-gathered on the last stage:
    (tensor - 1) / tensor of them per device.
    """
    if s.tensor == 1:
        return 0, 0, 0
    count = 2 * (cfg.num_layers // s.pipe) + 1
    act = batch * tokens * cfg.hidden_size * BYTES
    logits = batch * tokens * cfg.vocab_size * BYTES
    return count, count * act * 2 * (s.tensor - 1) // s.tensor, logits * (s.tensor - 1) // s.tensor


def pipe_bytes(cfg: ModelConfig, s: Setting, tokens: int, batch: int) -> int:
    """Bytes crossing every stage boundary per iteration: the [B, T, D] activations, (pipe - 1) hops."""
    return (s.pipe - 1) * batch * tokens * cfg.hidden_size * BYTES


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def memory_table() -> list[str]:
    rows = ["| model | mesh | devices | params | weights, total GB | weights per device GB | "
            "KV per slot per device, 1k tokens MB | KV per slot per device at 2048 GB | "
            "slots of 2048 tokens beside the weights in 24 GB | paper |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for s in SETTINGS:
        cfg = MODELS[s.model]
        total, per_device = weight_bytes(cfg, s.tensor, s.pipe)
        kv = kv_bytes_per_token(cfg, s.tensor, s.pipe)
        slots = max(int((A10_GB * GB - per_device) // (kv * CONTEXT)), 0)
        fits = str(slots) if per_device < A10_GB * GB else "none: weights exceed 24 GB"
        rows.append(f"| {s.model} | {s.mesh} | {s.devices} | {total // BYTES / 1e9:.2f} B | {_gb(total)} | "
                    f"{_gb(per_device)} | {_mb(kv * 1024)} | {_gb(kv * CONTEXT)} | {fits} | {s.paper} |")
    return rows


def comm_table() -> list[str]:
    rows = ["| model | mesh | batch | tokens per request | TP all-reduces per stage | "
            "TP all-reduce MB sent per device | logits all-gather MB per device | PP MB per stage hop | "
            "PP hops at 100 Gbps, us |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in SETTINGS:
        if not s.deployed or s.tensor * s.pipe == 1:
            continue
        cfg = MODELS[s.model]
        for batch in BATCHES:
            for tokens in TOKENS:
                count, sent, logits = tensor_bytes(cfg, s, tokens, batch)
                hop = pipe_bytes(cfg, s, tokens, batch) // max(s.pipe - 1, 1)
                link = pipe_bytes(cfg, s, tokens, batch) * 8 / (LINK_GBPS * 1e9) * 1e6
                pp = f"{_mb(hop)} | {link:.0f}" if s.pipe > 1 else "- | -"
                rows.append(f"| {s.model} | {s.mesh} | {batch} | {tokens} | {count} | {_mb(sent)} | "
                            f"{_mb(logits)} | {pp} |")
    return rows


def render() -> str:
    """The whole markdown table section (what docs/scale.md embeds between its markers)."""
    return "\n".join(
        ["### Per-device memory (float16)", "", *memory_table(), "",
         "### Communication per decoding iteration (float16)", "", *comm_table()]
    ) + "\n"


BEGIN = "<!-- scale_table.py: begin -->"
END = "<!-- scale_table.py: end -->"


def splice(doc: str, table: str) -> str:
    """``doc`` with the text between the markers replaced by ``table``."""
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"the document has no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="a markdown file to update between its scale_table.py markers "
                        "(created with the table alone if it does not exist)")
    args = parser.parse_args(argv)
    table = render()
    if not args.output:
        sys.stdout.write(table)
        return 0
    path = Path(args.output)
    doc = path.read_text(encoding="utf-8") if path.exists() else f"{BEGIN}\n{END}\n"
    path.write_text(splice(doc, table), encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
