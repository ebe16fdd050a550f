"""Structured output (issue 25): llguidance grammars, masks at every draft level and tree node, forced tokens.

Greedy constrained decoding with speculation must be token-identical to constrained
incremental decoding; sampled constrained decoding must draw from the LLM's masked,
renormalised distribution (chi-square); every output must match its grammar.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from scipy import stats

from jaxspec.decoding import constrain, sampling
from jaxspec.decoding.kv_cache import KVCache
from jaxspec.decoding.step import DecodeConfig, DecodeState, SSMGroup, decode_step, prefill, prefill_model
from jaxspec.decoding.tree import DynamicTree, expansion_topology
from jaxspec.engine import Engine, RequestError
from jaxspec.speculators.early_exit import early_exit
from jaxspec.structured import Grammar, GrammarError, RowMasks, Vocabulary, allowed
from models.config import ModelConfig
from models.loaded import LoadedModel
from models.transformer import init_params

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "difficulty": {"type": "string", "enum": ["easy", "medium", "hard"]},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["topic", "difficulty", "keywords"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), because [a-z ]{1,40}\."
LARK = r"""
start: "The answer is " NUMBER " " UNIT "."
NUMBER: /[0-9]{1,4}/
UNIT: "apples" | "pears" | "kilograms"
"""


# -- masks on the device ----------------------------------------------------------------------
def test_unpack_matches_llguidance_bit_order():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    bits = rng.integers(-2**31, 2**31, size=(3, constrain.words(vocab)), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    want = logits.copy()
    apply_token_bitmask_inplace(want, bits)
    got = np.asarray(constrain.apply(jnp.asarray(logits), jnp.asarray(bits)))
    np.testing.assert_array_equal(np.isinf(want), got == constrain.NEG)
    np.testing.assert_array_equal(np.where(np.isinf(want), 0, want), np.where(got == constrain.NEG, 0, got))


# -- the grammar engine on the default tokenizer (the tiny LLM's) --------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_checkpoint_llm) -> LoadedModel:
    """The tiny random LLM over the default tokenizer: masks, forced chains and constrained identity hold for any
    weights."""
    return tiny_checkpoint_llm


@pytest.fixture(scope="module")
def vocab(llm) -> Vocabulary:
    return Vocabulary(llm.tokenizer, llm.cfg.vocab_size, llm.cfg.eos_token_ids)


@pytest.mark.parametrize("grammar, needle", [
    (Grammar("json_schema", '{"type": "nonsense"}'), "nonsense"),
    (Grammar("regex", "a(b"), "unclosed group"),
    (Grammar("lark", "start: undefined_rule"), "undefined_rule"),
])
def test_a_grammar_that_does_not_compile_is_named(vocab, grammar, needle):
    with pytest.raises(GrammarError, match=needle):
        vocab.compile(grammar)


def test_bad_grammar_inputs_are_refused():
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema("{nope")
    with pytest.raises(GrammarError, match="kind"):
        Grammar("ebnf", "x")
    with pytest.raises(GrammarError, match="empty"):
        Grammar("regex", " ")


def test_grammars_compile_once_per_content(vocab):
    a = vocab.compile(Grammar.json_schema(SCHEMA))
    b = vocab.compile(Grammar.json_schema(json.dumps(SCHEMA, indent=2)))  # the same schema, other whitespace
    assert a is b


def _yes_no_rows(vocab, tok) -> tuple:
    """RowMasks over two rows, the first under the regex "(yes|no)"; its matcher and the ids of yes, no, cat."""
    m = vocab.matcher(vocab.compile(Grammar("regex", "(yes|no)")))
    rows = RowMasks(vocab)
    rows.begin([m, None])
    yes, no, cat = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "cat"))
    return rows, m, yes, no, cat


def test_row_masks_walk_paths_and_roll_back(vocab, llm):
    rows, m, yes, no, cat = _yes_no_rows(vocab, llm.tokenizer)
    # tree: root(0) -> yes(1), cat(2); yes -> eos(3)
    tokens = np.array([[0, yes, cat, 2]] * 2, np.int32)
    parent = np.array([[-1, 0, 0, 1]] * 2, np.int32)
    nodes = np.array([[0, 1, 2, 3]] * 2, np.int32)
    out = rows(tokens, parent, nodes)
    assert {yes, no} <= set(allowed(out[0, 0]).tolist()) and cat not in allowed(out[0, 0])
    assert allowed(out[0, 1]).tolist() == [2]  # after "yes" only EOS
    assert (out[0, 2] == -1).all()  # a path the grammar forbids is never accepted: left unmasked
    assert allowed(out[0, 3]).tolist() == [2]  # a finished grammar allows EOS only
    assert (out[1] == -1).all()  # a row without a grammar
    assert not m.is_error() and vocab.advance(m, [no, 2])[0] == 2  # the walk left the matcher where it was


class _Broken:
    """A matcher whose every call raises, as a bug or a failed llguidance call would."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"the matcher failed at {name} (injected)")


def test_a_failing_matcher_costs_its_row_only(vocab, llm):
    """A row whose matcher raises, in ``begin``'s pooled masks, in the mid-step callback, in ``chain_masks`` or in
    ``forced``, is recorded in ``failed`` and left unconstrained; the other row's masks are those it gets alone."""
    rows, m, yes, no, cat = _yes_no_rows(vocab, llm.tokenizer)
    tokens = np.array([[0, yes, cat, 2]] * 2, np.int32)
    parent = np.array([[-1, 0, 0, 1]] * 2, np.int32)
    nodes = np.array([[0, 1, 2, 3]] * 2, np.int32)
    alone = rows(tokens, parent, nodes)[0]  # [K, W]: the good matcher's masks as row 0 of rows [m, None]
    broken = RowMasks(vocab)
    broken.begin([_Broken(), m])  # the pooled call fails as a whole: each row's root mask comes alone
    out = broken(tokens, parent, nodes)
    assert (out[0] == -1).all() and (out[1] == alone).all()
    (exc,) = broken.take_failed().values()
    assert "injected" in str(exc) and broken.take_failed() == {}
    broken.begin([_Broken(), m])
    assert broken.forced(0, 4) == [] and list(broken.take_failed()) == [0]
    broken.begin([_Broken(), m])
    chains = broken.chain_masks([[], []], [[], []], 0, 0)  # [B, 1, W]
    assert (chains[0] == -1).all() and (chains[1, 0] == alone[0]).all() and list(broken.failed) == [0]
    assert not m.is_error() and vocab.advance(m, [no, 2])[0] == 2  # the good matcher was left where it was


def test_root_masks_of_several_rows_are_computed_together(vocab, llm):
    """``begin`` computes every constrained row's root mask in one parallel call: the same masks, row by row,
    as one matcher at a time, and the rows without a grammar stay unmasked."""
    yes_no = vocab.matcher(vocab.compile(Grammar("regex", "(yes|no)")))
    digits = vocab.matcher(vocab.compile(Grammar("regex", "[0-9]+")))
    vocab.advance(digits, llm.tokenizer.encode("12", add_special_tokens=False))
    rows = RowMasks(vocab)
    rows.begin([yes_no, None, digits])
    assert rows.masks == 2
    assert np.array_equal(rows.path_mask(0, ()), vocab.mask(yes_no))
    assert np.array_equal(rows.path_mask(2, ()), vocab.mask(digits))
    assert rows.masks == 2  # served from what begin computed
    assert 2 in allowed(rows.path_mask(2, ()))  # "12" may end: EOS allowed
    assert not set(allowed(rows.path_mask(0, ()))) & set(allowed(rows.path_mask(2, ())))
    out = rows.chain_masks([[], [], []], [[], [], []], 0, 0)
    assert (out[1] == -1).all() and np.array_equal(out[0, 0], vocab.mask(yes_no))


def test_forced_chain_of_a_compact_schema(vocab, llm):
    tok = llm.tokenizer
    m = vocab.matcher(vocab.compile(Grammar.json_schema(SCHEMA)))
    rows = RowMasks(vocab)
    rows.begin([m])
    chain = rows.forced(0, 8)
    assert tok.decode(chain) == '{"topic":"'
    text = tok.encode('{"topic":"x","difficulty":"easy","keywords":[]}', add_special_tokens=False)
    assert vocab.advance(m, text)[0] == len(text)
    rows.begin([m])
    assert rows.forced(0, 8) == [2]  # the grammar is complete: EOS is the one token left


def test_chain_masks_lay_out_root_forced_and_ngram_prefixes(vocab, llm):
    """A chains-only tree's masks are computed before dispatch; on the device (source, depth) finds each node's."""
    from jaxspec.decoding.tree import TokenTree

    rows, m, yes, no, cat = _yes_no_rows(vocab, llm.tokenizer)
    table = rows.chain_masks([[yes], []], [[cat, 2], []], forced_depth=2, ngram_depth=2)
    assert table.shape == (2, 5, vocab.words) and rows.callbacks == 0
    assert {yes, no} <= set(allowed(table[0, 0]).tolist())  # the root
    assert allowed(table[0, 1]).tolist() == [2]  # after the forced "yes": EOS only
    assert (table[0, 2] == -1).all()  # past the forced chain's end
    assert (table[0, 3] == -1).all() and (table[0, 4] == -1).all()  # "cat" is forbidden: left unmasked
    assert (table[1] == -1).all()  # a row without a grammar
    # merged tree of row 0: root, ngram "cat" (source 0) at depth 1, forced "yes" (source 1) at depth 1, padding
    tree = TokenTree(*(jnp.asarray(a, jnp.int32) for a in ([[0, cat, yes, 0]], [[-1, 0, 0, -1]], [[0, 1, 1, 0]])),
                     jnp.asarray([[True, True, True, False]]), jnp.asarray([[-1, 0, 1, -1]], jnp.int32),
                     jnp.asarray([[-1, 0, 0, -1]], jnp.int32))
    bits = np.asarray(constrain.chain_node_masks(jnp.asarray(table[:1]), tree, ("ngram", "forced"), 2))
    np.testing.assert_array_equal(bits[0, 0], table[0, 0])
    np.testing.assert_array_equal(bits[0, 1], table[0, 3])
    np.testing.assert_array_equal(bits[0, 2], table[0, 1])
    assert (bits[0, 3] == -1).all()  # padding


# -- sampled exactness on a tiny model with a path-dependent grammar --------------------------------
VOCAB = 16
TINY = ModelConfig("llama", VOCAB, 32, 64, 2, 4, 2, 8, max_position_embeddings=128)
PROMPT, ROOT, CAP = [3, 1, 4, 1], 5, 32


def rule(path: tuple[int, ...]) -> np.ndarray:
    """A test grammar: after ``path`` the allowed tokens are those t with (t + sum(path)) % 3 != 0."""
    ok = np.array([(t + sum(path)) % 3 != 0 for t in range(VOCAB)])
    padded = np.zeros(constrain.words(len(ok)) * 32, np.uint8)
    padded[: len(ok)] = ok
    return np.packbits(padded, bitorder="little").view(np.int32)


def rule_masks(tokens: np.ndarray, parent: np.ndarray, nodes: np.ndarray, committed: np.ndarray | None = None
               ) -> np.ndarray:
    """The rule's masks for nodes [B, K] of a tree (tokens/parent [B, P]); -1 (none) where a node is -1.

    ``committed`` [B]: the sum of the tokens each row committed since the rule's start (its matcher state).
    """
    rows = np.arange(nodes.shape[0])[:, None]
    node = np.maximum(nodes, 0)
    total = np.zeros(nodes.shape, np.int64) + (0 if committed is None else committed[:, None])
    for _ in range(parent.shape[1]):  # walk up to the root, summing the path's tokens
        total += np.where(node > 0, tokens[rows, node], 0)
        node = np.where(node > 0, parent[rows, node], 0)
    by_residue = np.stack([rule((r,)) for r in range(3)])  # the rule depends on the sum mod 3 only
    out = by_residue[total % 3]
    out[nodes < 0] = -1
    return out


def _tiny(seed: int, layers: int = 2) -> LoadedModel:
    cfg = TINY.replace(num_layers=layers)
    params = jax.jit(lambda: init_params(cfg, seed))()
    return LoadedModel(f"tiny-{seed}", cfg, jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params))


@pytest.mark.slow  # ~4 min cold; the default run keeps constrained greedy identity (auto) and grammar masks (incremental)
def test_sampled_constrained_tree_draws_from_the_masked_distribution():
    """MSS over a merged tree (two SSMs + a forced chain), masks at every level and node: the first two
    emitted tokens follow the LLM's masked, renormalised two-token law."""
    llm = _tiny(0)
    near, far = early_exit(llm, 1), _tiny(1, layers=1)
    spec = sampling.WarpSpec(greedy=False)
    b = 20_000
    forced = (1, 2)  # a proposal chain the rule forbids at its second token (sum 1 + 2 = 3): never accepted there
    cfg = DecodeConfig((expansion_topology((2, 2)), expansion_topology((1, 1))), spec, "mss", vocab=VOCAB,
                       grammar=True, forced_depth=len(forced))
    committed = np.zeros((b,), np.int64)  # what the rows' "matchers" consumed: step 2 starts after step 1's tokens
    masker = constrain.host_masker(lambda t, p, n: rule_masks(t, p, n, committed), VOCAB)
    chain = (jnp.broadcast_to(jnp.asarray(forced, jnp.int32), (b, len(forced))), jnp.full((b,), 2, jnp.int32))
    sfw = (near.forward, far.forward)

    def start(llm_params, ssm_params, key, values):
        state = DecodeState(KVCache.create(TINY, b, CAP), tuple(KVCache.create(s.cfg, b, CAP) for s in (near, far)),
                            jnp.zeros((b, CAP), jnp.int32), jnp.zeros((b,), jnp.int32), key, values)
        toks = jnp.broadcast_to(jnp.asarray(PROMPT, jnp.int32), (b, len(PROMPT)))
        state, _ = prefill(cfg, llm.forward, sfw, llm_params, ssm_params, state, toks, jnp.full((b,), len(PROMPT)))
        return state.replace(root=jnp.full((b,), ROOT, jnp.int32))

    step = jax.jit(lambda lp, sp, state: decode_step(cfg, llm.forward, sfw, lp, sp, state, None, chain, masker))
    values = sampling.warp_arrays(sampling.SamplerParams(temperature=1.0), b)
    ssm_params = (near.params, far.params)
    state = jax.jit(start)(llm.params, ssm_params, jax.random.PRNGKey(3), values)
    state, o1 = step(llm.params, ssm_params, state)
    t1, num = np.asarray(o1.tokens), np.asarray(o1.num)
    committed[:] = [row[: n].sum() for row, n in zip(t1, num)]  # the rows' grammar state after step 1
    _, o2 = step(llm.params, ssm_params, state)
    firsts = np.stack([t1[:, 0], np.where(num >= 2, t1[:, 1], np.asarray(o2.tokens)[:, 0])], axis=1)

    # the law: p(y1 | ctx) masked by rule(()), p(y2 | ctx, y1) masked by rule((y1,))
    ctx = PROMPT + [ROOT]
    seqs = np.concatenate([np.broadcast_to(np.asarray(ctx), (VOCAB, len(ctx))), np.arange(VOCAB)[:, None]], axis=1)

    def probs(seqs):
        cache = KVCache.create(TINY, VOCAB, seqs.shape[1])
        logits = prefill_model(llm.forward, llm.params, cache, jnp.asarray(seqs, jnp.int32),
                               jnp.full((VOCAB,), seqs.shape[1], jnp.int32))[0]
        return np.asarray(jax.nn.softmax(logits), np.float64)

    p1 = probs(seqs[:, :-1])[0] * np.unpackbits(rule(()).view(np.uint8), bitorder="little")[:VOCAB]
    p2 = probs(seqs) * np.stack([np.unpackbits(rule((y,)).view(np.uint8), bitorder="little")[:VOCAB]
                                 for y in range(VOCAB)])
    law = (p1 / p1.sum())[:, None] * (p2 / p2.sum(-1, keepdims=True))
    observed = np.bincount(firsts[:, 0] * VOCAB + firsts[:, 1], minlength=VOCAB * VOCAB)
    assert observed[law.ravel() == 0].sum() == 0  # never a token the grammar forbids
    keep = law.ravel() * b >= 5  # rare cells pooled into one (empty cells dropped)
    expected = np.append(law.ravel()[keep], law.ravel()[~keep].sum()) * b
    counts = np.append(observed[keep], observed[~keep].sum())
    counts, expected = counts[expected > 0], expected[expected > 0]
    pval = stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue
    assert 1.05 < num.mean(), num.mean()  # speculation accepted drafts
    assert pval > 1e-3, pval


@pytest.mark.slow  # auto's constrained identity stays in the default run
def test_greedy_constrained_tree_with_a_vmapped_pool_matches_masked_incremental():
    """A two-member vmapped SSM group and a dynamic tree, masked per level: greedy output equals greedy
    decoding of the masked LLM, token by token."""
    llm = _tiny(0)
    pool = (_tiny(1, layers=1), _tiny(2, layers=1))
    b, steps = 4, 6
    committed = np.zeros((b,), np.int64)
    masker = constrain.host_masker(lambda t, p, n: rule_masks(t, p, n, committed), VOCAB)
    prompts = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, size=(b, 5)), jnp.int32)
    spec = sampling.WarpSpec()

    def decode(cfg, ssms, groups_params):
        sfw = tuple(s.forward for s in ssms[: len(groups_params)])
        state = DecodeState(KVCache.create(TINY, b, 64),
                            tuple(KVCache.create(ssms[0].cfg, b, 64) if len(g.members) == 1 else
                                  jax.tree_util.tree_map(lambda x: jnp.stack([x] * len(g.members)),
                                                         KVCache.create(ssms[0].cfg, b, 64))
                                  for g in cfg.ssm_groups),
                            jnp.zeros((b, 64), jnp.int32), jnp.zeros((b,), jnp.int32), jax.random.PRNGKey(0),
                            sampling.warp_arrays(sampling.SamplerParams(), b))
        state, _ = prefill(cfg, llm.forward, sfw, llm.params, groups_params, state, prompts, jnp.full((b,), 5))
        state = state.replace(root=jnp.full((b,), 1, jnp.int32))  # the rule starts after this root
        committed[:] = 0
        step = jax.jit(lambda state: decode_step(cfg, llm.forward, sfw, llm.params, groups_params, state, None, None,
                                                 masker))
        out = [[] for _ in range(b)]
        for _ in range(steps):
            state, o = step(state)
            for r in range(b):
                new = [int(t) for t in o.tokens[r, : int(o.num[r])]]
                out[r] += new
                committed[r] += sum(new)
        return [row[:steps] for row in out]

    plain = DecodeConfig((), spec, vocab=VOCAB, grammar=True)
    want = decode(plain, pool, ())
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), pool[0].params, pool[1].params)
    group = (SSMGroup((0, 1)),)
    tree = DecodeConfig((expansion_topology((2, 1)),) * 2, spec, groups=group, vocab=VOCAB, grammar=True)
    dyn = DecodeConfig((DynamicTree(8, 3, 2),), spec, vocab=VOCAB, grammar=True)
    assert decode(tree, pool, (stacked,)) == want
    assert decode(dyn, pool[:1], (pool[0].params,)) == want
    for row in want:  # and the masked argmax obeyed the rule along the whole text
        path = [1]
        for t in row:
            assert (t + sum(path[1:])) % 3 != 0
            path.append(t)


# -- the default model, end to end -------------------------------------------------------------------
GRAMMARS = {
    "json_schema": Grammar.json_schema(SCHEMA),
    "regex": Grammar("regex", REGEX),
    "lark": Grammar("lark", LARK),
}
PROMPTS = {
    "json_schema": "Describe photosynthesis as a JSON object with a topic, a difficulty and keywords.",
    "regex": "Is the sky blue? Answer yes or no and say why.",
    "lark": "How many apples are in a basket of twelve? Answer in one sentence.",
}


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return re.fullmatch(r"The answer is [0-9]{1,4} (apples|pears|kilograms)\.", text) is not None


class _Outputs(dict):
    """(setup, grammar kind) -> constrained greedy output, each setup's outputs made on first use (a setup's steps
    compile: the default run asks for incremental and auto only)."""

    def __init__(self, builders: dict, tokenizer):
        super().__init__()
        self.builders, self.tokenizer = builders, tokenizer

    def __missing__(self, key):
        from models.tokenizer import encode_prompt

        engine = self.builders[key[0]]()
        for kind, g in GRAMMARS.items():
            self[key[0], kind] = engine.generate(encode_prompt(self.tokenizer, PROMPTS[kind], True), 48, grammar=g)
        self[key[0], "callbacks"] = engine.row_masks().callbacks
        return self[key]


@pytest.fixture(scope="module")
def outputs(llm, tiny_drafter):
    """Constrained greedy outputs of every grammar under incremental decoding and three speculative setups (auto's
    merged drafter + n-gram tree, the shipped pool's tree, a dynamic tree), on the tiny LLM."""
    from jaxspec.speculators.resolve import load_speculators

    def ssms(spec: str):
        return load_speculators([spec], llm, "float32")
    builders = {
        "incremental": lambda: Engine(llm, ()),
        "auto": lambda: Engine(llm, ssms(f"drafter:{tiny_drafter}") + ssms("ngram:3"), ((1, 1, 1), (1, 1, 1, 1, 1, 1)),
                               auto=True, forced_tokens=8),
        "auto-unforced": lambda: Engine(llm, ssms(f"drafter:{tiny_drafter}") + ssms("ngram:3"),
                                        ((1, 1, 1), (1, 1, 1, 1, 1, 1)), auto=True),
        "pool-tree": lambda: Engine(llm, ssms("default"), (1, 1, 3, 1), forced_tokens=8),
        "dynamic": lambda: Engine(llm, ssms(f"drafter:{tiny_drafter}"), DynamicTree(16, 4, 4), forced_tokens=8),
    }
    return _Outputs(builders, llm.tokenizer), llm.tokenizer


# A fixed setup compiles its own constrained steps: the default run keeps auto.
@pytest.mark.parametrize("setup", ["auto", pytest.param("pool-tree", marks=pytest.mark.slow),
                                   pytest.param("dynamic", marks=pytest.mark.slow)])
def test_greedy_constrained_speculation_is_identical_to_constrained_incremental(outputs, setup):
    out, tok = outputs
    for kind in GRAMMARS:
        want, got = out["incremental", kind], out[setup, kind]
        assert got.token_ids == want.token_ids, (kind, tok.decode(want.token_ids), tok.decode(got.token_ids))


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_outputs_match_their_grammar_and_end_with_eos(outputs, kind):
    out, tok = outputs
    gen = out["incremental", kind]
    assert gen.finish_reason == "eos" and gen.token_ids[-1] == 2  # the grammar ended: EOS was forced
    assert valid(kind, tok.decode(gen.token_ids, skip_special_tokens=True)), tok.decode(gen.token_ids)


@pytest.mark.slow  # builds the pool-tree and dynamic setups (~4 min cold)
def test_only_trees_with_ssm_drafts_ask_the_host_for_masks_mid_step(outputs):
    out, _ = outputs
    assert out["incremental", "callbacks"] == 0  # the root's mask is an input: the step dispatches asynchronously
    assert out["pool-tree", "callbacks"] > 0 and out["dynamic", "callbacks"] > 0
    assert out["dynamic", "json_schema"].tokens_per_step > 1.0  # the forced keys and punctuation ride in the tree


def test_forced_tokens_and_masked_drafts_raise_tokens_per_step(outputs):
    """The chain a grammar forces rides in the tree: auto with it emits the same JSON as auto without it, in fewer
    steps (how many fewer follows the text the weights write between the forced keys)."""
    out, _ = outputs
    forced, unforced = out["auto", "json_schema"], out["auto-unforced", "json_schema"]
    assert out["incremental", "json_schema"].tokens_per_step == 1.0
    assert forced.token_ids == unforced.token_ids
    assert forced.llm_steps < unforced.llm_steps and forced.tokens_per_step > 1.0, (forced.llm_steps,
                                                                                     unforced.llm_steps)


def test_an_uncompilable_grammar_is_a_request_error(llm):
    engine = Engine(llm, ())
    with pytest.raises(RequestError, match="does not compile"):
        engine.generate([1, 2, 3], 4, grammar=Grammar("regex", "(unclosed"))


@pytest.mark.slow  # the only count of prepare(grammar=True) on a speculating engine with forced chains
def test_preparing_structured_output_compiles_every_grammar_step_a_request_needs(llm):
    """After ``prepare(grammar=True)`` a constrained request compiles nothing; without it, it compiles grammar steps."""
    from jaxspec.engine.core import EngineCore, Request
    from jaxspec.speculators.resolve import load_speculators
    from models.tokenizer import encode_prompt

    prompt = encode_prompt(llm.tokenizer, PROMPTS["json_schema"], True)
    counts = {}
    for warm in (True, False):
        engine = Engine(llm, load_speculators(["ngram:3"], llm, "float32"), (1, 1, 1, 1), forced_tokens=4)
        batch = EngineCore(engine, max_batch=1, max_model_len=len(prompt) + 64)
        batch.prepare(warps=[sampling.WarpSpec()], grammar=warm, progress=False)
        assert engine.forced_buckets() == (0, 4)
        other = [prompt[0] + 1] + prompt[1:]  # same chunks, no shared prefix to reuse
        batch.generate([Request(other, 4)])
        before = engine.compilations
        gen = batch.generate([Request(prompt, 48, grammar=GRAMMARS["json_schema"])])[0]
        assert valid("json_schema", llm.tokenizer.decode(gen.token_ids, skip_special_tokens=True))
        counts[warm] = engine.compilations - before
    assert counts[True] == 0 and counts[False] > 0, counts


@pytest.mark.slow  # ~1 min cold; test_prefix_cache keeps hits (incremental, drafter) in the default run
def test_a_constrained_request_on_a_prefix_cache_hit_is_unchanged(llm):
    """A grammar-constrained request whose prompt the prefix cache holds starts after the cached blocks and emits
    what it emits cold (with n-gram speculation and forced chains)."""
    from jaxspec.engine.core import EngineCore, Request
    from jaxspec.speculators.resolve import load_speculators
    from models.tokenizer import encode_prompt

    prompt = encode_prompt(llm.tokenizer, PROMPTS["json_schema"], True)
    engine = Engine(llm, load_speculators(["ngram:3"], llm, "float32"), (1, 1, 1, 1), forced_tokens=4)
    requests = [Request(prompt, 48, grammar=GRAMMARS["json_schema"]), Request([prompt[0] + 1, 5, 6], 2),
                Request(prompt, 48, grammar=GRAMMARS["json_schema"])]  # the middle one takes the staging row
    cold = EngineCore(engine, max_batch=1, max_model_len=len(prompt) + 64, reuse_prefix=False)
    want = cold.generate(requests)
    got = EngineCore(engine, max_batch=1, max_model_len=len(prompt) + 64).generate(requests)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert got[0].cached_tokens == 0 and got[2].cached_tokens == min(len(prompt) // 16 * 16, len(prompt) - 1) > 0
    assert valid("json_schema", llm.tokenizer.decode(got[2].token_ids, skip_special_tokens=True))


# -- the command line ---------------------------------------------------------------------------------
def test_cli_grammar_flags_and_per_prompt_grammars(tmp_path, capsys, tiny_checkpoint):
    from jaxspec import cli

    model = ["--model", str(tiny_checkpoint)]

    assert cli.main(["generate", *model, "--mode", "incremental", "--prompt", "hi", "--json-schema",
                     str(tmp_path / "none.json")]) == 2
    assert "--json-schema: file not found" in capsys.readouterr().err
    assert cli.main(["generate", *model, "--prompt", "hi", "--mode", "incremental", "--regex", "(unclosed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxspec: error:") and "does not compile" in err and "unclosed group" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Is ice cold?", "regex": "(yes|no)!"}) + "\n"
                       + json.dumps({"id": "b", "prompt": "Name a fruit.", "json_schema": {
                           "type": "object", "properties": {"fruit": {"enum": ["apple", "pear"]}},
                           "required": ["fruit"], "additionalProperties": False}}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", *model, "--prompt-file", str(prompts), "--mode", "incremental",
                     "--max-new-tokens", "16", "--output", str(out)]) == 0
    a, b = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
    assert re.fullmatch("(yes|no)!", a["text"]) and a["finish_reason"] == "eos"
    assert json.loads(b["text"])["fruit"] in ("apple", "pear")


def test_racing_callers_share_one_row_masks(llm):
    """The engine thread, the event loop and llguidance's pool may ask for the grammar state at once: all must get
    the one object that holds the matchers (a second one, made by a racing caller, would hold none of them)."""
    import threading

    from jaxspec.engine import Engine

    engine = Engine(llm)
    start = threading.Barrier(8)
    got = []

    def ask() -> None:
        start.wait()
        got.append(engine.row_masks())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len({id(x) for x in got}) == 1


# -- the prepared set: few executables, shared by every grammar (issue 75) -------------------------------------------
def _auto(llm, tiny_drafter, *specs: str, forced: int = 8) -> Engine:
    from jaxspec.speculators.resolve import load_speculators

    ssms = load_speculators([f"drafter:{tiny_drafter}", *specs], llm, "float32")
    return Engine(llm, ssms, ((1, 1, 1),) + ((1, 1, 1),) * len(specs), auto=True, forced_tokens=forced)


def _listed(batch, grammar: bool, callbacks: bool = True) -> list[str]:
    buckets = [(w, r, c) for w in sampling.BATCH_WARPS for r in batch.row_buckets for c in batch.capacity_buckets]
    return [label for label, _ in batch.planner.step_jobs(buckets, grammar, callbacks)]


def test_grammar_steps_share_one_executable_per_bucket(llm, tiny_drafter):
    """Under auto a grammar's masks are arguments of the plain steps of the members without SSM drafts, and its
    forced chain's tokens and count are arguments of one step: preparing structured output adds one stored
    executable per bucket ("none" with a chain at --forced-tokens' depth), whatever the forced depth; a fixed tree
    of SSM drafts (masks from a callback mid-step) adds two (without and with the chain), which a server prepares
    only when asked (``callbacks``: no store keeps them)."""
    from jaxspec.engine.core import EngineCore
    from jaxspec.speculators.resolve import load_speculators

    for forced in (4, 8):
        batch = EngineCore(_auto(llm, tiny_drafter, "ngram:3", forced=forced), max_batch=4, max_model_len=256)
        buckets = len(sampling.BATCH_WARPS) * len(batch.row_buckets) * len(batch.capacity_buckets)
        plain, both = _listed(batch, False), _listed(batch, True)
        extra = [label for label in both if label not in plain]
        assert len(plain) == 4 * buckets and len(both) == len(plain) + buckets, extra
        assert all(label.startswith(f"step none under a grammar forcing {forced},") for label in extra), extra
        engine = batch.engine
        family = engine.family(sampling.WarpSpec())
        assert engine.grammar_members(sampling.WarpSpec()) == ["none", "ngram"]  # no SSM drafts: no callback
        assert engine._step_fn(engine.constrained(family["none"], forced)).persist  # stored like a plain step

    ssm = load_speculators(["default"], llm, "float32")
    for forced in (4, 8):
        fixed = EngineCore(Engine(llm, ssm, (1, 1, 3, 1), forced_tokens=forced), max_batch=4, max_model_len=256)
        buckets = len(sampling.BATCH_WARPS) * len(fixed.row_buckets) * len(fixed.capacity_buckets)
        assert len(_listed(fixed, True)) == 3 * buckets, _listed(fixed, True)
        assert _listed(fixed, True, callbacks=False) == _listed(fixed, False)
        assert fixed.engine.forced_buckets() == (0, forced)


def test_a_default_server_fits_the_default_map_limit_and_a_set_over_it_is_refused_by_name(llm, tiny_drafter):
    """What a default server prepares (16 slots, auto with the drafter and the n-gram, both warps, grammar steps
    included), counted at the default model's mappings per executable, fits Linux's default vm.max_map_count with
    a quarter to spare (before issue 75 it listed 283 executables, three times the ~95 one process can hold). The
    count happens before anything compiles: a set over the limit's share is refused, naming the limit and the flags
    that reduce it; an accelerator's executables are not counted."""
    from jaxspec.engine.core import EngineCore
    from jaxspec.engine.device.prepare import DEFAULT_MAX_MAP_COUNT, ROOM, check_room, estimated_maps, mapped

    batch = EngineCore(_auto(llm, tiny_drafter, "ngram:3"), max_batch=16)
    buckets = [(w, r, c) for w in sampling.BATCH_WARPS for r in batch.row_buckets for c in batch.capacity_buckets]
    ex = batch.executor
    jobs = [*batch.planner.step_jobs(buckets, grammar=True, callbacks=False),
            *ex.prefill_jobs(batch.chunks.reachable(None), batch.capacity_buckets),
            *ex.row_jobs(batch.row_buckets, batch.capacity_buckets)]
    need = estimated_maps([label for label, _ in jobs])
    assert len(jobs) < 95 and need < ROOM * DEFAULT_MAX_MAP_COUNT, (len(jobs), need)
    check_room(jobs, limit=int((mapped() + need + 1000) / ROOM), platform="cpu")
    small = mapped() + need // 2
    with pytest.raises(RequestError, match=rf"prepares {len(jobs)} executables.*vm\.max_map_count.*--max-batch"):
        check_room(jobs, limit=small, platform="cpu")
    check_room(jobs, limit=small, platform="gpu")


def test_a_prepared_structured_server_compiles_nothing_and_fits_the_mappings(llm, tiny_drafter):
    """``prepare(grammar=True)`` as a server calls it (both warps, every bucket): JSON-schema and regex requests,
    greedy and sampled, then trace nothing, and the process holds under half of vm.max_map_count's mappings."""
    from jaxspec.engine.core import EngineCore, Request
    from jaxspec.engine.device.prepare import map_limit, mapped
    from models.tokenizer import encode_prompt

    batch = EngineCore(_auto(llm, tiny_drafter, "ngram:3"), max_batch=2, max_model_len=256)
    batch.prepare(grammar=True, progress=False)
    assert mapped() < map_limit() / 2, (mapped(), map_limit())
    before = batch.engine.compilations
    requests = [Request(encode_prompt(llm.tokenizer, PROMPTS[kind], True), 32, grammar=GRAMMARS[kind],
                        params=sampling.SamplerParams(temperature, seed=7))
                for kind in ("json_schema", "regex") for temperature in (0.0, 0.8)]
    gens = batch.generate(requests)
    assert batch.engine.compilations == before, batch.engine.traced[before:]
    for kind, gen in zip(("json_schema", "json_schema", "regex", "regex"), gens):
        text = llm.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        assert gen.finish_reason == "length" or (gen.finish_reason == "eos" and valid(kind, text)), (kind, text)


def test_a_server_with_recorded_costs_is_ready_at_its_plain_steps_and_loads_its_members_beside_it(llm, tiny_drafter):
    """``serve``'s preparation on a machine that recorded every member's cost (injected here, as its records would
    be): before the first request only the plain step and its grammar step are readied at each bucket; every
    speculative member then loads on a host thread at once (a server cannot know its requests ahead), unasked, and
    runs once loaded; structured and plain requests give the tokens a fully prepared loop gives, and nothing traces
    on the loop's thread after the loads."""
    import time

    from jaxspec.engine.core import EngineCore, Request
    from jaxspec.speculators.resolve import load_speculators
    from models.tokenizer import encode_prompt

    ssms = load_speculators([f"drafter:{tiny_drafter}", "ngram:3"], llm, "float32")

    def core(costs: dict) -> EngineCore:
        return EngineCore(Engine(llm, ssms, ((1, 1, 1),) * 2, auto=True, forced_tokens=8, costs=costs), max_batch=2,
                          max_model_len=256)

    warp = sampling.WarpSpec()
    names = list(core({"none": 1.0}).engine.family(warp))
    served = core({n: 1.0 if n == "none" else 0.5 for n in names})  # speculation priced to pay: the chooser tries it
    served.prepare(warps=(warp,), grammar=True, callbacks=False, progress=False, beside=True, load_all=True)
    engine, cap = served.engine, served.capacity_buckets[0]
    assert served.planner.loader is not None and not served.planner.later  # every member queued at once
    members = {r: served.planner.members(warp, r) for r in served.row_buckets}
    for _ in range(900):  # they load on a host thread; wait for them
        if all(engine.is_warm(warp, cap, r, n) for r, names_r in members.items() for n in names_r):
            break
        assert not served.planner.loader.failed, served.planner.loader.failed
        time.sleep(0.2)
    assert all(engine.is_warm(warp, cap, r, n) for r in served.row_buckets for n in ("none", "ssm", "ngram"))
    beside = [label for label, _ in served.planner.loader.ready]  # each speculative member's step, on the thread
    expected = sum(len(names_r) - 1 for names_r in members.values())  # every member but the plain step
    assert len(beside) == expected and not any(b.startswith("step none") for b in beside), beside
    requests = [Request(encode_prompt(llm.tokenizer, PROMPTS["regex"], True), 24, grammar=GRAMMARS["regex"]),
                Request(encode_prompt(llm.tokenizer, "Count: one two three one two three one two", True), 24)]
    before = engine.compilations
    gens = served.generate(requests)
    assert engine.compilations == before, engine.traced[before:]
    assert any(t != "none" for g in gens for t in g.trees), [g.trees for g in gens]  # the loaded members ran
    plain = EngineCore(Engine(llm, forced_tokens=8), max_batch=2, max_model_len=256)
    assert [g.token_ids for g in gens] == [g.token_ids for g in plain.generate(requests)]
    served.planner.stop_readying()
