"""``jaxspec export-drafter``: writes a feature drafter the engine loads in a format other engines read (the
``speculators`` format of EAGLE-3 heads, which vLLM loads)."""

from __future__ import annotations

import argparse

from jaxspec.errors import CliError

FORMATS = ("speculators",)


def add_parser(sub) -> None:
    """Registers ``jaxspec export-drafter --ssm SPEC [--format speculators] OUT``."""
    p = sub.add_parser("export-drafter", help="write an EAGLE-3 drafter (--ssm eagle3:DIR or a detected directory) "
                                              "in the speculators format vLLM loads")
    p.add_argument("out", metavar="OUT", help="directory to write (config.json, model.safetensors)")
    p.add_argument("--ssm", required=True, metavar="SPEC", help="the drafter, as --ssm names it for generate")
    p.add_argument("--model", help="the LLM it drafts for (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--format", choices=FORMATS, default="speculators")
    p.add_argument("--verifier", metavar="NAME_OR_PATH",
                   help="the target recorded as speculators_config.verifier (vllm serve OUT loads it as the LLM; "
                        "default: the --model file's name), e.g. its Hugging Face id")
    p.add_argument("--speculative-tokens", type=int, default=3,
                   help="draft depth recorded as the greedy proposal method (vLLM's num_speculative_tokens default)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Loads the drafter against its LLM (every check the engine makes) and writes it in ``args.format``."""
    from jaxspec.speculators.eagle3 import export_speculators  # noqa: PLC0415 (JAX loads only here)
    from jaxspec.speculators.resolve import load_llm, load_speculators  # noqa: PLC0415

    if args.speculative_tokens < 1:
        raise CliError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    llm = load_llm(args.model)
    loaded = load_speculators([args.ssm], llm)
    if len(loaded) != 1 or not getattr(loaded[0], "features", False):
        raise CliError(f"--ssm {args.ssm!r} is not a feature drafter: only EAGLE-3 heads export")
    out = export_speculators(loaded[0], llm, args.out, args.speculative_tokens, args.verifier)
    print(f"wrote {args.format} drafter {out}")
    return 0
