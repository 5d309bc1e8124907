"""An EAGLE draft (Li et al. 2024): one decoder layer that reads the target's own features, with a reduced vocabulary.

A draft model must guess the target's next token from scratch; EAGLE's draft is handed the target's
final hidden state f_t (what the target already knows at position t) and the embedding of the token
x_{t+1} chosen after it, and predicts the next feature:

    u_t      = W_fc [e(x_{t+1}); f_t]              a linear map 2C -> C
    f^_{t+1} = Llama block + final RMSNorm (u_t)   ONE decoder layer of the target's shape, with its own KV cache
    q        = softmax(f^_{t+1} E_S^T)              the target's frozen LM head, rows S only

Drafting continues from its own guess: the next step reads (f^_{t+1}, x_{t+2}). The layer is a
one-block ``Llama`` (``Llama.blocks``), so its cache, RoPE and grouped attention are the target's code.

The reduced vocabulary (FR-Spec, Zhao et al. 2025): SmolLM2 ties its LM head, 49,152 x 576 = 28M
weights, more than the draft layer itself; the draft scores only the V' tokens S that are most
frequent in the training text (``frequency_subset``, V' chosen by ``subset_coverage`` against the
cost). q is zero outside S, and every rule that accepts a draft token reads q(x) with x in S, so
rejection sampling stays exact: a token outside S is simply never proposed, and the target emits it
when it wants it.

``EagleProposer`` drafts each round as a chain (K steps of the layer) or, as EAGLE-2 does, as a tree
grown by confidence: each depth expands the ``width`` nodes of highest path probability by their
top ``top_k`` tokens, and the ``max_nodes`` best nodes are verified in one target forward
(``minillm.token_tree``). ``EagleLookup`` adds prompt lookup's chain (chapter 9) beside the draft's where the
text repeats itself.

    python -m minillm eagle-train --data DIR --out eagle.npz      (``minillm.eagle_train``)
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from .backend import to_numpy, weight_product, xp
from .checkpoint import (
    FLOAT_WEIGHTS,
    HEADER_KEY,
    SHIPPED_DIR,
    TOKEN_IDS,
    CheckpointError,
    atomic_save_npz,
    check_format,
    check_not_shipped,
    check_trained_for,
    encode_header,
    host_float32,
    model_identity,
    read_npz,
    trained_file,
)
from .draft_free import MAX_NGRAM, long_ngram_lookup
from .kv_cache import KVCache, MaskedView
from .llama import Llama, model_weight
from .model import new_positions
from .quantize import FORMATS, block_format, kept_in_blocks
from .sampling import finite_real, sample
from .token_tree import Proposal, Round, TokenTree

EAGLE_FORMAT = "minillm-eagle-1"
MIN_SUBSET, DEFAULT_SUBSET = 16, 8192
MAX_DEPTH = 12  # draft tokens per round (chain length or tree depth)
MAX_TREE_NODES = 64
HEAD_FORMATS = ("Q8_0", "Q4_1")  # a draft's head requantized (``head_in``): SmolLM2 keeps its own in Q8_0
DRAFT_KIND = "EAGLE draft"
DRAFT_RETRAIN = "python -m minillm eagle-data --out DIR, then eagle-train --data DIR --out DRAFT.npz"
DRAFT_OPTION = "--eagle-draft DRAFT.npz"


def check_int(name: str, value, low: int, high: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------------------------
# the reduced vocabulary


def token_counts(sequences, vocab_size: int) -> np.ndarray:
    """How often each token id occurs in ``sequences``: (vocab_size,) int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        counts += np.bincount(np.asarray(seq, dtype=np.int64), minlength=vocab_size)
    return counts


def frequency_subset(counts, size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent token ids (ties: smaller id first), ``always`` included, sorted by id.

    Example: counts [5, 0, 9, 1], size 2 -> [0, 2]; with always (3,) -> [2, 3].
    """
    counts, forced = np.asarray(counts), sorted({int(t) for t in always})
    lowest = max(MIN_SUBSET, len(forced)) if len(counts) >= MIN_SUBSET else 1  # a tiny test vocabulary: any size
    size = check_int("the draft vocabulary size V'", size, lowest, len(counts))
    ranked = [int(t) for t in np.argsort(-counts, kind="stable") if int(t) not in forced]
    return np.array(sorted([*forced, *ranked[: size - len(forced)]]), dtype=np.int64)


def subset_coverage(counts, sizes) -> dict:
    """{V': share of the counted tokens that the V' most frequent ids cover} (FR-Spec's measure)."""
    ranked = np.sort(np.asarray(counts))[::-1]
    total = max(int(ranked.sum()), 1)
    return {int(n): float(ranked[: int(n)].sum() / total) for n in sizes}


# ----------------------------------------------------------------------------------------------
# the draft


def check_tap_layers(config, layers) -> tuple:
    """EAGLE-3's tap layers, the blocks whose input a draft reads beside the top state: distinct ints in
    1..n_layer - 1 -> a tuple; ValueError otherwise."""
    layers = list(layers)
    if not layers or len(set(layers)) != len(layers) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 1 <= t < config.n_layer for t in layers):
        raise ValueError(f"tap layers must be distinct blocks in 1..{config.n_layer - 1}, got {layers}")
    return tuple(int(t) for t in layers)


def draft_param_shapes(config, subset_size: int, taps: int = 0) -> dict:
    """The trained parameters: fc (C, 2C) [out, in], one decoder layer and the final norm of the target's shape;
    with ``taps`` lower features, EAGLE-3's fuse (C, (taps + 1) C) too."""
    layer = replace(config, n_layer=1, vocab_size=subset_size, tie_embeddings=True)  # its head: E_S
    shapes = {k: v for k, v in layer.param_shapes().items() if k != "embed_tokens.weight"}
    fuse = {"fuse.weight": (config.n_embd, (taps + 1) * config.n_embd)} if taps else {}
    return {"fc.weight": (config.n_embd, 2 * config.n_embd)} | fuse | shapes


def in_target_format(target, params: dict) -> dict:
    """The draft's matrices in the blocks the target keeps its own in: each matrix of the draft's layer in the
    format of the same matrix of the target's last block (Q4_1 in SmolLM2's file), fc in that of its q_proj; the
    norms, and every matrix of a float32 target, stay as they are. A draft step then reads the bytes its weights
    cost in the target's format, through the target's kernels (``minillm.qkernels``)."""
    last = f"layers.{target.config.n_layer - 1}."
    like = {name: target.params[last + ("self_attn.q_proj.weight" if name == "fc.weight" else name.removeprefix(
        "layers.0."))] for name in params if name == "fc.weight" or name.startswith("layers.0.")}
    return {name: block_format(like[name]).quantize(host_float32(w))
            if name in like and np.ndim(w) == 2 and kept_in_blocks(like[name]) else w for name, w in params.items()}


def head_in(name: str, rows):
    """The head's rows E_S requantized to the blocks of ``name`` (one of ``HEAD_FORMATS``): SmolLM2's head is
    Q8_0, 8.5 bits a weight, half a draft step's bytes; in Q4_1 it is 5 bits a weight, and the draft's guesses
    move with it."""
    if name not in HEAD_FORMATS:
        raise ValueError(f"a draft's head format must be one of {', '.join(HEAD_FORMATS)}, got {name!r}")
    return FORMATS[name].quantize(host_float32(rows))


class EagleDraft:
    """EAGLE's draft on a frozen ``target`` (a ``Llama``): ``params`` (``draft_param_shapes``) and ``subset`` ids.

    ``keep_blocks``: keep the matrices in the target's blocks (``in_target_format``) and the head as the target's
    own blocks of the rows S, for drafting; the default keeps float32 arrays, which training updates. With
    ``head_format`` (drafting only) the head's rows are requantized to that format's blocks (``head_in``)."""

    def __init__(self, target, params: dict, subset, keep_blocks: bool = False, tap_layers=(),
                 head_format: str | None = None):
        if not isinstance(target, Llama):
            raise ValueError(f"an EAGLE draft reads a Llama's features (smollm2-135m), not a {type(target).__name__}'s")
        self.target = target
        cfg = target.config
        subset = np.asarray(subset, dtype=np.int64)
        if subset.ndim != 1 or len(subset) < 1 or len(np.unique(subset)) != len(subset) \
                or subset.min() < 0 or subset.max() >= cfg.vocab_size:
            raise ValueError(f"the draft vocabulary must be distinct token ids in 0..{cfg.vocab_size - 1}")
        self.subset = subset  # (V',) sorted
        self.to_subset = np.full(cfg.vocab_size, -1, dtype=np.int64)  # full id -> subset index, -1 outside
        self.to_subset[subset] = np.arange(len(subset))
        self.tap_layers = check_tap_layers(cfg, tap_layers) if len(tap_layers) else ()  # EAGLE-3's fused inputs
        shapes = draft_param_shapes(cfg, len(subset), len(self.tap_layers))
        for name, shape in shapes.items():
            if name not in params or tuple(params[name].shape) != shape:
                got = tuple(params[name].shape) if name in params else "missing"
                raise ValueError(f"EAGLE draft parameter {name}: expected shape {shape}, got {got}")
        self.config = replace(cfg, n_layer=1, vocab_size=len(subset), tie_embeddings=True)  # the head E_S
        head = target.lm_head
        if head_format is not None and not keep_blocks:
            raise ValueError("a draft's head_format is for drafting (keep_blocks=True): training updates float32")
        if keep_blocks:
            params = in_target_format(target, params)
        layer_params = {k: v for k, v in params.items() if k not in ("fc.weight", "fuse.weight")}
        rows = head.unpack(subset) if keep_blocks and kept_in_blocks(head) else head[xp.asarray(subset)]  # E_S, frozen
        layer_params["embed_tokens.weight"] = rows if head_format is None else head_in(head_format, rows)  # (V', C)
        self.layer = Llama(self.config, layer_params, attention=target.attention_name)  # one block, its own stacks
        own = ("fc.weight", "fuse.weight")  # the input projections: not the layer's
        self.params = {name: model_weight(params[name]) if kept_in_blocks(params[name])
                       else xp.asarray(params[name], dtype=xp.float32) for name in own if name in shapes} | {
            name: self.layer.params[name] for name in shapes if name not in own}

    @classmethod
    def init(cls, target, subset, seed: int = 0, tap_layers=()) -> EagleDraft:
        """A fresh draft: the layer starts as a float32 copy of the target's last block (its blocks dequantized when
        the target keeps them: the same start from either load), fc as [small noise | identity], and with
        ``tap_layers`` the fuse as [small noise for each tap | identity] (the top feature passes)."""
        cfg, p = target.config, target.params
        C = cfg.n_embd
        rng = np.random.default_rng(seed)
        last = f"layers.{cfg.n_layer - 1}."
        params = {name: host_float32(p[last + name.removeprefix("layers.0.")])
                  for name in draft_param_shapes(cfg, len(subset)) if name.startswith("layers.0.")}
        params["norm.weight"] = host_float32(p["norm.weight"])
        fc = np.concatenate([rng.normal(0.0, 0.02, (C, C)), np.eye(C)], axis=1)  # u = f at first
        params["fc.weight"] = fc.astype(np.float32)
        if tap_layers:
            fuse = np.concatenate([rng.normal(0.0, 0.02, (C, C * len(tap_layers))), np.eye(C)], axis=1)
            params["fuse.weight"] = fuse.astype(np.float32)
        return cls(target, params, subset, tap_layers=tap_layers)

    @property
    def subset_size(self) -> int:
        return len(self.subset)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(replace(self.config, block_size=max(max_len, self.config.block_size)), max_len=max_len)

    def step(self, features, tokens, cache=None, last: bool = False):
        """Features f (T, C) and the tokens after them (T,) -> (f^ (T, C), subset logits (T, V'), or (1, V') of the
        last row with ``last``: a catch-up over many rows reads only that one, and the head is half the draft's
        bytes).

        Row t reads (f_t, x_{t+1}) and guesses f_{t+1} and q of x_{t+2}. With a cache (or a
        ``MaskedView``) the rows sit after the cached ones. A draft with tap layers also reads the target's
        rows [taps; f] ((T, (taps + 1) C)), fused to one feature; its own f^ it reads as it is.
        """
        tokens = xp.asarray(np.asarray(tokens, dtype=np.int64))
        e = self.target.params["embed_tokens.weight"][tokens]  # (T, C)
        f = xp.asarray(features, dtype=xp.float32)
        if f.shape[-1] != e.shape[-1]:
            f = weight_product(f[None], self.params["fuse.weight"])[0]  # (T, C)
        u = weight_product(xp.concatenate([e, f], axis=-1)[None], self.params["fc.weight"])  # (1, T, C)
        pos = new_positions(u.shape[1], cache, self.config)
        f_hat = self.layer.blocks(u, pos, cache)[0]  # (T, C)
        return f_hat, self.layer.logits(f_hat[-1:] if last else f_hat)

    def full_probs(self, subset_probs) -> np.ndarray:
        """(..., V') probabilities over the subset -> (..., V) over the vocabulary, zero outside it."""
        # EXERCISE 11.3 BEGIN: place column i at token id subset[i]; every id outside the subset gets 0
        subset_probs = np.asarray(subset_probs, dtype=np.float64)
        out = np.zeros((*subset_probs.shape[:-1], self.target.config.vocab_size))
        out[..., self.subset] = subset_probs
        return out
        # EXERCISE 11.3 END

    def save(self, path, notes: dict | None = None, overwrite_shipped: bool = False) -> None:
        """float16 parameters, the subset and the identity of the target, atomically."""
        check_not_shipped(path, overwrite_shipped)
        header = {"format": EAGLE_FORMAT, "model": model_identity(self.target), "subset_size": self.subset_size,
                  "tap_layers": list(self.tap_layers), "notes": notes or {}}
        if any(kept_in_blocks(p) for p in self.params.values()):
            raise ValueError("this draft keeps its weights in blocks for drafting; save the float32 draft "
                             "(EagleDraft.load(..., keep_blocks=False))")
        arrays = {name: to_numpy(p).astype(np.float16) for name, p in self.params.items()}
        atomic_save_npz(path, arrays | {"subset": self.subset.astype(np.int32), HEADER_KEY: encode_header(header)})

    @classmethod
    def load(cls, target, path, keep_blocks: bool = True, head_format: str | None = None) -> EagleDraft:
        """A draft saved by ``save``, its matrices in the target's blocks unless ``keep_blocks`` is False (its head
        in ``head_format``'s, when given); CheckpointError (one line) for another format, a draft trained for
        another target, or an array of another name, shape or dtype (all before any array is read), or not finite."""
        header, arrays = read_npz(path, lambda header: draft_layout(header, target, path), DRAFT_KIND)
        subset = arrays.pop("subset")
        return cls(target, arrays, subset, keep_blocks, header.get("tap_layers", []), head_format)


def draft_layout(header: dict, target, path) -> dict:
    """The arrays a draft file's header implies for ``target``: {name: (shape, dtypes)}, once the header is
    checked (its format, the target it was trained for, the size of its vocabulary)."""
    check_format(header, EAGLE_FORMAT, path, DRAFT_KIND)
    check_trained_for(header, target, path, DRAFT_KIND, DRAFT_RETRAIN)
    size = check_int("its draft vocabulary size (subset_size)", header.get("subset_size"), 1, target.config.vocab_size)
    taps = header.get("tap_layers", [])
    try:
        if not isinstance(taps, list):
            raise ValueError
        if taps:
            check_tap_layers(target.config, taps)
    except ValueError:
        raise CheckpointError(f"inconsistent {DRAFT_KIND} {path}: tap_layers must list blocks in "
                              f"1..{target.config.n_layer - 1}") from None
    shapes = draft_param_shapes(target.config, size, len(taps))
    return {name: (shape, FLOAT_WEIGHTS) for name, shape in shapes.items()} | {"subset": ((size,), TOKEN_IDS)}


def shipped_draft_path(model_name: str) -> Path:
    """The EAGLE draft shipped for a model name: "smollm2-135m" -> minillm/models/eagle_smollm2-135m.npz."""
    return SHIPPED_DIR / f"eagle_{model_name}.npz"


def load_draft(target, model_name: str, path=None) -> EagleDraft:
    """The draft at ``path`` (``--eagle-draft``), or when none is given the one shipped for ``model_name``."""
    path = trained_file(path, shipped_draft_path(model_name), model_name, DRAFT_KIND, DRAFT_RETRAIN, DRAFT_OPTION)
    return EagleDraft.load(target, path)


# ----------------------------------------------------------------------------------------------
# proposing: a chain or an EAGLE-2 tree each round


class EagleProposer:
    """Each round: bring the draft's cache up to the target's, then draft a chain or a tree.

    mode "chain": up to ``depth`` draft steps; at temperature 0 each takes the draft's argmax, else a
    sample from q (the target's sampling settings on the draft's logits), and the round hands q to
    the verifier. The chain goes past a token only where the draft gave it probability ``confidence`` or
    more (q at the token drawn; at temperature 0 the softmax of the draft's logits at its argmax): EAGLE-2's
    observation that a draft's confidence tracks how often its guess is accepted, used to size a chain round
    by round (0, the default: always ``depth`` tokens). mode "tree": ``depth`` levels; each expands the
    ``width`` open nodes of highest path probability by their ``top_k`` likeliest tokens (deterministic
    candidates, q one-hot), and the ``max_nodes`` - 1 best nodes of all drafted form the tree (scores only
    fall along a path, so they are prefix-closed).
    """

    def __init__(self, draft: EagleDraft, mode: str = "chain", depth: int = 5, top_k: int = 4, width: int = 4,
                 max_nodes: int = 16, seed: int = 0, confidence: float = 0.0):
        if mode not in ("chain", "tree"):
            raise ValueError(f"EAGLE drafting mode must be 'chain' or 'tree', got {mode!r}")
        if not finite_real(confidence) or not 0 <= confidence <= 1:
            raise ValueError(f"the EAGLE chain's confidence is a probability in [0, 1], got {confidence!r}")
        self.confidence = float(confidence)
        self.draft, self.mode = draft, mode
        self.max_depth = check_int("the EAGLE draft depth K", depth, 1, MAX_DEPTH)
        self.top_k = check_int("the EAGLE tree's top_k", top_k, 1, 16)
        self.width = check_int("the EAGLE tree's width", width, 1, 16)
        self.max_nodes = check_int("the EAGLE tree's max_nodes", max_nodes, 2, MAX_TREE_NODES)
        self.rng = np.random.default_rng(seed)
        self.cache, self.synced = None, 0
        self.draft_calls = 0  # draft forwards, for the cost model
        self.tap_layers = draft.tap_layers  # the target hands over these blocks' inputs too (``target_rows``)

    def sync(self, state: Round):
        """Feed the draft the pairs (f_j, x_{j+1}) of the positions the target just kept -> (f^, logits) of the last.

        The draft's cache then holds one entry per target position; what it drafted past that is dropped.
        """
        kept = state.kept_hidden  # (m, C) (or [taps; f]): the last m positions of the target's cache
        m = kept.shape[0]
        room = state.cache.max_len + self.top_k * (1 + (self.max_depth - 1) * self.width)  # + a tree's drafts
        if self.cache is None or self.cache.max_len < room:
            self.cache = self.draft.new_cache(room)
            self.synced = 0
        if state.cache.length - m != self.synced:  # the target started over (a new prompt, a slid window)
            self.synced = 0
        self.cache.truncate(self.synced)
        f_hat, logits = self.draft.step(kept, state.seq[len(state.seq) - m :], self.cache, last=True)
        self.synced += m
        self.draft_calls += 1
        return f_hat[-1], to_numpy(logits[-1])

    def propose(self, state: Round) -> Proposal:
        root = state.seq[-1]
        if state.kept_hidden is None or state.room < 1 or state.n_pending != 1:
            self.synced = 0 if state.n_pending != 1 else self.synced
            return Proposal(TokenTree((root,), (-1,)))
        f, logits = self.sync(state)
        depth = min(self.max_depth, state.room)
        if self.mode == "chain":
            return self.chain(root, f, logits, depth, state.settings)
        return self.tree(root, f, logits, depth)

    def chain(self, root, f, logits, depth, settings) -> Proposal:
        tokens, q_rows = [], {}
        for i in range(depth):
            if settings.greedy:
                j = int(np.argmax(logits))
                sure = 1.0 / np.exp(np.float64(logits) - logits[j]).sum() if self.confidence else 1.0  # softmax at j
            else:  # draw in the subset, map the id; the verifier reads q over the whole vocabulary
                q_subset = settings.probs(logits)  # (V',)
                j = sample(q_subset, self.rng)
                sure = q_subset[j]
                q_rows[i + 1] = self.draft.full_probs(q_subset)
            x = int(self.draft.subset[j])
            tokens.append(x)
            if i + 1 == depth or sure < self.confidence:
                break
            f_hat, row = self.draft.step(f[None], [x], self.cache)
            f, logits = f_hat[0], to_numpy(row[0])
            self.draft_calls += 1
        return Proposal(TokenTree.chain(root, tokens), draft_probs=q_rows)

    def tree(self, root, f, logits, depth) -> Proposal:
        """EAGLE-2's growth by confidence; the root's children come from ``logits``, each deeper level from
        one draft forward over that level's new nodes only (EAGLE-2's ``topK_genrate``): their keys and
        values stay in the draft's cache, where the next level's nodes see their ancestors among them
        (``MaskedView``'s ``seen``; the next ``sync`` truncates them). At the defaults (depth 5, top_k 4,
        width 4) that is 4 + 16 + 16 + 16 rows per round, not the 4 + 20 + 36 + 52 of feeding every node
        drafted so far at every level."""
        tokens, parents, logp, feats = [root], [-1], [0.0], [None]  # drafted nodes, node 0 the root
        open_nodes, level_logits, level_feats = [0], {0: logits}, {0: f}
        in_cache = []  # the drafted nodes whose K/V follow the confirmed entries, in that order
        for level in range(depth):
            ranked = sorted(open_nodes, key=lambda n: -logp[n])[: self.width]
            new = []
            for n in ranked:
                lg = level_logits[n].astype(np.float64)
                lp = lg - lg.max() - math.log(np.exp(lg - lg.max()).sum())
                for j in np.argsort(-lp, kind="stable")[: self.top_k]:
                    tokens.append(int(self.draft.subset[j]))
                    parents.append(n)
                    logp.append(logp[n] + float(lp[j]))
                    feats.append(level_feats[n])
                    new.append(len(tokens) - 1)
            if level + 1 == depth:
                break
            tree = TokenTree(tuple(tokens), tuple(parents))
            ancestors = tree.mask()  # (N, N): node i sees node j when j is i or an ancestor of i
            view = MaskedView(self.cache, tree.depths[new] - 1, np.eye(len(new), dtype=bool),
                              seen=ancestors[np.ix_(new, in_cache)].reshape(len(new), len(in_cache)))
            f_hat, rows = self.draft.step(xp.stack([feats[n] for n in new]), [tokens[n] for n in new], view)
            in_cache += new
            self.draft_calls += 1
            rows = to_numpy(rows)
            level_logits = {n: rows[i] for i, n in enumerate(new)}
            level_feats = {n: f_hat[i] for i, n in enumerate(new)}
            open_nodes = new
        best = sorted(range(1, len(tokens)), key=lambda n: (-logp[n], n))[: self.max_nodes - 1]
        keep = sorted(best)  # a parent scores at least its child, so it is kept too, and comes first
        index = {old: new for new, old in enumerate([0, *keep])}
        tree = TokenTree((root, *(tokens[n] for n in keep)), (-1, *(index[parents[n]] for n in keep)))
        return Proposal(tree)

    def observe(self, state: Round, emitted: list, extra_logits) -> None:
        pass


class EagleLookup:
    """EAGLE's chain, and beside it prompt lookup's chain (``draft_free``) where the text's last ``min_ngram`` or
    more tokens occurred before: both paths go into one tree (``TokenTree.from_paths``), merged where they agree.

    The draft guesses text the target writes anew; lookup guesses text the reply copies (a pasted passage, a
    name, a line of code), which the draft guesses badly. A lookup of a single token matches too often on free
    text to pay for its rows, so ``min_ngram`` is 2 by default. The lookup's tokens are deterministic candidates
    and the draft's keep their q, so the exact rule stays lossless (``verify_tree``). Everything else (the draft's
    cache, its forwards, its vocabulary) is the ``EagleProposer``'s, whose chain it extends.
    """

    def __init__(self, eagle: EagleProposer, max_draft: int, min_ngram: int = 2):
        if eagle.mode != "chain":
            raise ValueError(f"EagleLookup extends an EAGLE chain, not a {eagle.mode}")
        long_ngram_lookup([0], min_ngram, MAX_NGRAM, max_draft)  # checks the arguments
        self.eagle, self.max_draft, self.min_ngram = eagle, max_draft, min_ngram
        self.max_depth = max(eagle.max_depth, max_draft)
        self.draft, self.tap_layers = eagle.draft, eagle.tap_layers

    @property
    def synced(self) -> int:
        return self.eagle.synced

    @property
    def draft_calls(self) -> int:
        return self.eagle.draft_calls

    def propose(self, state: Round) -> Proposal:
        proposal = self.eagle.propose(state)
        copied = long_ngram_lookup(state.seq, self.min_ngram, MAX_NGRAM, self.max_draft)[: state.room]
        if not copied:
            return proposal
        drafted = list(proposal.tree.tokens[1:])  # a chain: node i + 1 is its i-th token, kept as node i + 1 below
        return replace(proposal, tree=TokenTree.from_paths(state.seq[-1], [drafted, copied]))

    def observe(self, state: Round, emitted: list, extra_logits) -> None:
        pass
