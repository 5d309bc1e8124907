"""Medusa heads (chapter 9): the heads' backward pass, training, the sparse tree they propose, and
decoding with them: the target's own output with the exact rule, and NOT the target's distribution
with typical acceptance (a chi-square test that is meant to reject).

Statistical tests run at fixed seeds (deterministic) with chapter 5's chi-square harness.
"""

import numpy as np
import pytest
from test_speculative import P_MIN, chi2_pvalue

from minillm import GPT, GPTConfig, generate
from minillm.backend import to_numpy, xp
from minillm.checkpoint import SHIPPED_DIR, CheckpointError
from minillm.kv_cache import KVCache
from minillm.medusa import MAX_HEADS, MedusaHeads, MedusaProposer, shipped_heads_path, sparse_tree_paths
from minillm.medusa_train import HEADS_TRAIN, head_data, heads_forward_backward, train_heads
from minillm.sampling import logits_to_probs
from minillm.token_tree import tree_generate

# Tests that also run other exercises' code, so they fail until those are solved (minillm.tools.course): the
# heads train with AdamW (A1.3) on text decoded with the KV cache (chapter 3); the tree loop verifies
# with 9.1 and 9.2, lossless sampling uses chapter 5's residual, SmolLM2 runs chapter 8's Llama

TINY_TRAIN = HEADS_TRAIN.__class__(**{**HEADS_TRAIN.__dict__, "max_steps": 150, "batch_size": 64, "lr": 1e-2,
                                      "min_lr": 1e-3})
PROMPTS = [[0], [1, 2, 3], [5, 5, 5, 5], [12, 0, 7], [4, 8] * 6]


def peaked_model(vocab_size, block_size, seed=0, scale=20.0):
    """A random GPT whose weights are scaled up so its next-token distributions are peaked (like a trained model)."""
    cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16)
    return GPT(cfg, {k: v * scale if v.ndim == 2 else v for k, v in GPT.init(cfg, seed=seed).numpy_params().items()})


def own_text(model, n_seqs, length, seed=0):
    """Self-distillation on a toy: sequences the model samples itself at temperature 1."""
    V = model.config.vocab_size
    return [[i % V, *generate(model, [i % V], length - 1, temperature=1.0, seed=seed + i).tokens]
            for i in range(n_seqs)]


@pytest.fixture(scope="module")
def trained():
    """(model, 3 heads trained on the model's own samples, training history): V = 13, block 32."""
    model = peaked_model(13, 32)
    heads, history = train_heads(model, own_text(model, 40, 32), 3, tc=TINY_TRAIN, progress=False)
    return model, heads, history


# ----------------------------------------------------------------------------------------------
# the heads: data, backward, training


@pytest.mark.uses_exercise("13.1", "A1.3", "3.1", "3.3", "8.1", "8.2", "8.3")
def test_heads_train_on_a_model_kept_in_blocks():
    """Heads sharing the LM head of a Llama whose matrices stay in Q8_0 / Q4_1 blocks (weights="q") train as on
    the same weights in float32: the backward multiplies by the LM head both ways, so its blocks are dequantized
    once, and the loss curve is the float32 model's within float32 rounding (the hidden states differ by it)."""
    from test_quantized_model import TINY, tiny_params

    from minillm.llama import Llama

    blocks, dense = tiny_params()
    q, ref = Llama(TINY, blocks), Llama(TINY, dense)
    text = own_text(ref, 8, 24)
    tc = TINY_TRAIN.__class__(**{**TINY_TRAIN.__dict__, "max_steps": 10})
    losses = [[r["loss"] for r in train_heads(m, text, 2, tc=tc, progress=False)[1]] for m in (q, ref)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-3)


def test_head_data_aligns_head_k_with_token_t_plus_k_plus_2():
    """Row t pairs the hidden state at t with tokens t+1 (the LM head's) .. t+K+1 (head K-1's)."""
    model = peaked_model(13, 32)
    h, targets = head_data(model, [[5, 6, 7, 8, 9]], 2)
    assert targets.tolist() == [[6, 7, 8], [7, 8, 9]]
    assert np.allclose(h, to_numpy(model.hidden(xp.asarray([[5, 6, 7, 8, 9]])))[0, :2])
    _, targets = head_data(model, [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6]], 2, starts=[1, 2])
    assert targets.tolist() == [[7, 8, 9], [4, 5, 6]]  # row 1 of the first, row 2 of the second
    with pytest.raises(ValueError, match="long enough"):
        head_data(model, [[1, 2, 3]], 2)


@pytest.mark.parametrize("own_projection", [True, False])
def test_backward_matches_finite_differences(own_projection):
    """Every gradient of sum_k 0.8^k CE_k (residual block, SiLU, own or shared projection) equals a
    central finite difference in float64 (rel. error < 1e-6)."""
    rng = np.random.default_rng(0)
    C, V, N, K = 6, 7, 5, 3
    params = {}
    for k in range(K):
        params |= {f"{k}.w": rng.normal(0, 0.7, (C, C)), f"{k}.b": rng.normal(0, 0.5, C)}
        if own_projection:
            params[f"{k}.lm"] = rng.normal(0, 0.7, (V, C))
    lm_head, h = rng.normal(0, 0.7, (V, C)), rng.normal(0, 1.0, (N, C))
    targets = rng.integers(0, V, (N, K))
    params = {name: xp.asarray(p) for name, p in params.items()}
    lm_head, h, targets = xp.asarray(lm_head), xp.asarray(h), xp.asarray(targets)
    _, _, grads = heads_forward_backward(params, lm_head, h, targets)
    assert grads.keys() == params.keys()
    eps = 1e-6
    for name, p in params.items():
        numeric = np.zeros(p.shape)
        for i in np.ndindex(p.shape):
            old = float(p[i])
            p[i] = old + eps
            plus = heads_forward_backward(params, lm_head, h, targets)[0]
            p[i] = old - eps
            minus = heads_forward_backward(params, lm_head, h, targets)[0]
            p[i] = old
            numeric[i] = (plus - minus) / (2 * eps)
        assert np.abs(to_numpy(grads[name]) - numeric).max() <= 1e-6 * max(1.0, np.abs(numeric).max()), name


def test_heads_start_as_the_lm_head():
    """W = 0, b = 0: every head's logits are the LM head's (each head starts by repeating its guess)."""
    model = peaked_model(13, 32)
    h = model.hidden(np.array([[1, 2, 3]]))[0]
    for share in (True, False):
        heads = MedusaHeads.init(model, 2, share_lm_head=share)
        assert heads.shared_lm_head is share
        assert np.allclose(heads.logits(h), model.logits(h)[None], atol=1e-5)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "A1.3")
def test_training_lowers_the_loss_and_beats_the_untrained_heads(trained):
    """150 steps on the model's own samples: the training loss falls by more than 10 %, and on fresh
    samples every head's cross-entropy is lower than the untrained head's (which repeats the LM
    head's +1 guess) and its top-5 accuracy higher."""
    model, heads, history = trained
    first, last = history[0]["loss"], np.mean([r["loss"] for r in history[-20:]])
    assert last < 0.9 * first
    h, targets = head_data(model, own_text(model, 10, 32, seed=100), 3)
    untrained = MedusaHeads.init(model, 3)
    on_device = xp.asarray(h), xp.asarray(targets[:, 1:])
    _, before, _ = heads_forward_backward(untrained.params, model.lm_head, *on_device)
    _, after, _ = heads_forward_backward(heads.params, model.lm_head, *on_device)
    assert all(a < b for a, b in zip(after, before)), (before, after)
    top5 = [heads.accuracy(h, targets[:, 1:]), untrained.accuracy(h, targets[:, 1:])]
    assert all(top5[0][k]["top5"] > top5[1][k]["top5"] for k in top5[0]), top5


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "A1.3")
def test_resume_continues_exactly(tmp_path):
    """Stopped after 20 steps and resumed to 40, training ends with the heads of an uninterrupted 40-step run."""
    model = peaked_model(13, 32)
    text = own_text(model, 6, 32)
    tc20, tc40 = (TINY_TRAIN.__class__(**{**TINY_TRAIN.__dict__, "max_steps": n, "ckpt_every": 10}) for n in (20, 40))
    whole, _ = train_heads(model, text, 2, tc=tc40, progress=False)
    state = tmp_path / "heads.medusa-train.npz"
    train_heads(model, text, 2, tc=tc20, state_path=state, progress=False)
    resumed, history = train_heads(model, text, 2, tc=tc40, state_path=state, resume=True, progress=False)
    assert len(history) == 40
    assert all(np.array_equal(whole.params[k], resumed.params[k]) for k in whole.params)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "A1.3")
def test_resume_of_a_finished_state_returns_it_for_the_export(tmp_path):
    """A crash in medusa-train's export (after the last checkpoint) could never be resumed ("already at
    step 20 of 20"): resuming a finished state gives back its heads and history, for the command to save."""
    model = peaked_model(13, 32)
    text = own_text(model, 6, 32)
    tc20 = TINY_TRAIN.__class__(**{**TINY_TRAIN.__dict__, "max_steps": 20, "ckpt_every": 10})
    state = tmp_path / "heads.medusa-train.npz"
    heads, history = train_heads(model, text, 2, tc=tc20, state_path=state, progress=False)
    again, history_again = train_heads(model, text, 2, tc=tc20, state_path=state, resume=True, progress=False)
    assert history_again == history
    assert all(np.array_equal(heads.params[k], again.params[k]) for k in heads.params)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "A1.3")
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_diverged_heads_training_stops_with_one_line(tmp_path):
    """lr 1e4 made NaN heads that were saved without a word: training stops at the first non-finite
    loss or gradient norm, and the state saved before it is the last one written."""
    model = peaked_model(13, 32)
    tc = TINY_TRAIN.__class__(**{**TINY_TRAIN.__dict__, "max_steps": 60, "ckpt_every": 60, "lr": 1e4,
                                 "warmup_steps": 1})
    with pytest.raises(ValueError, match="training diverged at step"):
        train_heads(model, own_text(model, 6, 32), 2, tc=tc, state_path=tmp_path / "s.npz", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", ["h.npz", "h.medusa-train.npz", "h.medusa-text.npz", "h.log.json"])
def test_command_refuses_existing_files_unless_overwrite(existing, tmp_path):
    """medusa-train replaced any file at --out and beside it: each existing one is refused before any
    work (the model is not even loaded) unless --overwrite; the run's own files (state, text, log) may
    be continued by --resume, but --resume alone never replaces the heads file at --out."""
    import argparse

    from minillm.tools.medusa_cli import add_arguments, run

    (tmp_path / existing).write_text("mine")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "h.npz"), "--model", "no-such-model"])
    with pytest.raises(ValueError, match=f"{existing} already exists: pass --overwrite"):
        run(args)
    past_the_check = ["--overwrite"] if existing == "h.npz" else ["--overwrite", "--resume"]
    for flag in past_the_check:
        with pytest.raises(CheckpointError, match="unknown model 'no-such-model'"):
            run(p.parse_args(["--out", str(tmp_path / "h.npz"), "--model", "no-such-model", flag]))
    if existing == "h.npz":
        with pytest.raises(ValueError, match="h.npz already exists: pass --overwrite"):
            run(p.parse_args(["--out", str(tmp_path / "h.npz"), "--model", "no-such-model", "--resume"]))
    assert (tmp_path / existing).read_text() == "mine"


# ----------------------------------------------------------------------------------------------
# the sparse tree


def test_sparse_tree_worked_example():
    """Paths ranked by the product of head probabilities; the kept set is a tree (prefix-closed)."""
    probs = np.array([[0.6, 0.2, 0.1, 0.1], [0.1, 0.1, 0.5, 0.3]])  # head 0: a=0, b=1; head 1: c=2, d=3
    assert sparse_tree_paths(probs, (2, 2), 4) == [[0], [0, 2], [1], [0, 3]]
    rng = np.random.default_rng(0)
    for _ in range(20):
        probs = rng.dirichlet(np.full(9, 0.3), size=3)
        paths = sparse_tree_paths(probs, (4, 3, 2), 15)
        assert len(paths) == 15 and all(p[:-1] in paths for p in paths if len(p) > 1)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "A1.3")
def test_proposer_root_only_before_the_first_forward(trained):
    """No hidden state yet (the first round) or no room: the tree is the root alone."""
    from minillm.token_tree import Round

    model, heads, _ = trained
    proposer = MedusaProposer(heads, (3, 2, 2), 12)
    assert proposer.propose(Round([1, 2], 2, None, None, 5)).tree.size == 1
    h = model.hidden(np.array([[1, 2]]))[0, -1]
    assert proposer.propose(Round([1, 2], 1, None, h, 0)).tree.size == 1
    tree = proposer.propose(Round([1, 2], 1, None, h, 5)).tree
    assert tree.size == 12 and tree.tokens[0] == 2 and tree.depth <= 3


# ----------------------------------------------------------------------------------------------
# decoding


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2", "A1.3")
@pytest.mark.parametrize("cache_len", [None, 10])
def test_greedy_identical_to_generate(trained, cache_len):
    """Greedy tree decoding with Medusa trees is generate(temperature=0) token for token, for 5 prompts,
    48 new tokens (past the 32-token context), also in a 10-position cache that re-prefills often;
    typical acceptance at temperature 0 is the same greedy walk. Trees are accepted beyond their root."""
    model, heads, _ = trained
    accepted = 0
    for prompt in PROMPTS:
        cache = None if cache_len is None else KVCache(model.config, max_len=cache_len)
        ref = generate(model, prompt, 48, temperature=0).tokens if cache is None else \
            generate(model, prompt, 48, temperature=0, cache=KVCache(model.config, max_len=cache_len)).tokens
        for rule in ("exact", "typical"):
            out = tree_generate(model, prompt, 48, MedusaProposer(heads, (3, 2, 2), 12), temperature=0, cache=cache,
                                rule=rule)
            assert out.tokens == ref, (prompt, rule)
            assert out.stats.reprefills > 0
            accepted += out.stats.accepted
    assert accepted > 30


@pytest.fixture(scope="module")
def four_tokens():
    """(model, 2 heads) on a V = 4 vocabulary: the first three tokens fall into 4^3 = 64 cells."""
    model = peaked_model(4, 16, seed=3, scale=6.0)
    return model, train_heads(model, own_text(model, 30, 16), 2, tc=TINY_TRAIN, progress=False)[0]


def sampled_triples(model, heads, rule, n_runs):
    """n_runs seeded tree_generate runs of 3 tokens at T = 1 with Medusa trees (top_k (2, 2))
    -> (triples as a * 16 + b * 4 + c, the target's exact joint over 64 cells, accepted tree tokens).
    The first round has no hidden state (the root alone); the second verifies a tree."""
    prompt, cache, accepted = [1, 2, 0], KVCache(model.config), 0
    triples = []
    for s in range(n_runs):
        out = tree_generate(model, prompt, 3, MedusaProposer(heads, (2, 2), 7), temperature=1.0, seed=s,
                            cache=cache, rule=rule)
        triples.append(out.tokens[0] * 16 + out.tokens[1] * 4 + out.tokens[2])
        accepted += out.stats.accepted
    joint, prefixes = np.ones(1), [prompt]
    for _ in range(3):
        p = logits_to_probs(model.forward(np.array(prefixes))[:, -1])  # (4**i, 4)
        joint = (joint[:, None] * p).ravel()
        prefixes = [pre + [t] for pre in prefixes for t in range(4)]
    return triples, joint, accepted


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "A1.3")
def test_exact_rule_keeps_the_target_distribution(four_tokens):
    """T = 1, exact rule (recursive rejection over the Medusa tree): the first three tokens follow the
    target's joint distribution over 4^3 cells (chi-square, N = 300 runs, of which a third or more
    accept a tree token). Fewer runs reject typical acceptance's output at p < 1e-9 (next test)."""
    triples, joint, accepted = sampled_triples(*four_tokens, "exact", 300)
    assert accepted > 90
    assert chi2_pvalue(triples, joint) >= P_MIN


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2", "A1.3")
def test_typical_rule_is_not_lossless(four_tokens):
    """The lesson of typical acceptance: on the same setup, it accepts a plausible candidate with
    probability 1 instead of p(x), so the first three tokens do NOT follow the target's distribution.
    This chi-square test is expected to reject, and does so by a wide margin (p < 1e-9; about 3e-16
    at this seed) already at N = 200."""
    triples, joint, accepted = sampled_triples(*four_tokens, "typical", 200)
    assert accepted > 100
    assert chi2_pvalue(triples, joint) < 1e-9


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("k", [0, MAX_HEADS + 1, 2.5, True])
def test_number_of_heads_out_of_range(k):
    with pytest.raises(ValueError, match="number of Medusa heads"):
        MedusaHeads.init(peaked_model(13, 32), k)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "A1.3")
@pytest.mark.parametrize("top_k,max_nodes,match", [((2, 2, 2, 2), 8, "one entry per head"), ((), 8, "one entry"),
                                                   ((2, 0), 8, "ints >= 1"), ((2, 2), 0, "max_nodes")])
def test_proposer_bad_arguments(trained, top_k, max_nodes, match):
    _, heads, _ = trained
    with pytest.raises(ValueError, match=match):
        MedusaProposer(heads, top_k, max_nodes)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "A1.3")
def test_heads_file_for_another_model_is_refused(trained, tmp_path):
    """Save/load round trip (float16); loading onto a model with other weights or another config is
    one clear ValueError; a model checkpoint is not a heads file; a shipped file is not replaced."""
    model, heads, _ = trained
    path = tmp_path / "heads.npz"
    heads.save(path)
    back = MedusaHeads.load(model, path)
    assert all(np.allclose(back.params[k], heads.params[k], atol=1e-2) for k in heads.params)
    with pytest.raises(ValueError, match="another model .lm_head_sha256"):
        MedusaHeads.load(peaked_model(13, 32, seed=1), path)
    with pytest.raises(ValueError, match="another model .config"):
        MedusaHeads.load(peaked_model(13, 16), path)
    from minillm.checkpoint import save_model
    from minillm.tokenizer import CharTokenizer

    save_model(tmp_path / "model.npz", model, CharTokenizer.from_text("abcdefghijklm"))
    with pytest.raises(CheckpointError, match="not a Medusa heads file"):
        MedusaHeads.load(model, tmp_path / "model.npz")
    shipped = SHIPPED_DIR / "target.npz"
    before = shipped.stat().st_mtime_ns
    with pytest.raises(ValueError, match="shipped with minillm"):
        heads.save(shipped)
    assert shipped.stat().st_mtime_ns == before


def test_heads_for_another_model_name_the_heads_both_models_and_medusa_train(tmp_path):
    """The refusal names what was loaded (Medusa heads), the file, the model they were made for and the
    command that trains heads for this one."""
    path = tmp_path / "heads.npz"
    MedusaHeads.init(peaked_model(13, 32), 2).save(path)
    with pytest.raises(CheckpointError) as exc_info:
        MedusaHeads.load(peaked_model(13, 16), path)
    message = str(exc_info.value)
    assert "Medusa heads trained for another model (config differs: block_size 32 vs 16)" in message
    assert str(path) in message and "trained for GPT (n_layer 1, n_embd 16, vocab_size 13" in message
    assert "medusa-train" in message and "\n" not in message


@pytest.mark.parametrize("edit,match", [
    (lambda h, a: a.update(extra=np.zeros(3, np.float16)), r"unexpected \['extra'\]"),
    (lambda h, a: a.update({"0.w": a["0.w"].astype(np.int8)}), "0.w is int8, expected float16 or float32"),
    (lambda h, a: a.update({"1.b": a["1.b"].astype(np.complex64)}), "1.b is complex64"),
    (lambda h, a: h.update(n_heads=3), r"missing \['2.b', '2.lm', '2.w'\]"),
    (lambda h, a: h.update(shared_lm_head="no"), "shared_lm_head is 'no'"),
    (lambda h, a: a["0.lm"].__setitem__((0, 0), np.inf), "0.lm holds non-finite values"),
], ids=["extra-array", "int8", "complex", "more-heads", "shared-not-bool", "inf"])
def test_a_heads_file_of_other_arrays_is_refused(tmp_path, edit, match):
    """Heads are checked like a model: every array's name, shape and dtype from the member headers
    against what the header and the model imply (int8 and complex weights were cast and used), then finite."""
    from minillm.checkpoint import HEADER_KEY, atomic_save_npz, encode_header, read_npz

    model = peaked_model(13, 32)
    MedusaHeads.init(model, 2, share_lm_head=False).save(tmp_path / "heads.npz")
    header, arrays = read_npz(tmp_path / "heads.npz")
    edit(header, arrays)
    atomic_save_npz(tmp_path / "bad.npz", arrays | {HEADER_KEY: encode_header(header)})
    with pytest.raises(CheckpointError, match=match):
        MedusaHeads.load(model, tmp_path / "bad.npz")


def test_load_heads_refuses_an_empty_name_and_says_when_a_file_is_missing(tmp_path):
    from minillm.medusa import load_heads

    model = peaked_model(13, 32)
    with pytest.raises(ValueError, match="Medusa heads file name is empty"):
        load_heads(model, "target", "")
    with pytest.raises(CheckpointError, match="Medusa heads not found: .*missing.npz"):
        load_heads(model, "target", tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="no Medusa heads ship for model 'mine'; train them .*medusa-train.*"
                       "then pass --medusa-heads HEADS.npz"):
        load_heads(model, "mine")


# ----------------------------------------------------------------------------------------------
# the shipped heads of the character model

shipped = pytest.mark.skipif(not shipped_heads_path("target").is_file(), reason="no shipped Medusa heads")


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2", "A1.3")
@shipped
def test_shipped_heads_accuracy_and_greedy_identity():
    """The shipped heads on the shipped target: head 0 (+2) top-1 accuracy on 2 windows of the
    validation split above a floor measured once (0.30 on 16 windows; floor 0.24), and greedy Medusa
    decoding of a Shakespeare prompt is the target's own greedy text at > 1.4 tokens per target call."""
    from minillm.checkpoint import load_model
    from minillm.data import train_val_split

    model, tok = load_model("target")
    heads = MedusaHeads.load(model, shipped_heads_path("target"))
    _, val = train_val_split(tok)
    h, targets = head_data(model, [val[:256], val[1024:1280]], heads.n_heads)
    assert heads.accuracy(h, targets[:, 1:])["head 0 (+2)"]["top1"] > 0.24
    prompt = tok.encode("ROMEO:\nWhat light through yonder window")
    out = tree_generate(model, prompt, 40, MedusaProposer(heads), temperature=0)
    assert out.tokens == generate(model, prompt, 40, temperature=0).tokens
    assert out.stats.tokens_per_call > 1.4


@pytest.mark.parametrize("argv,match", [(["--heads", "0"], "number of Medusa heads"),
                                        (["--steps", "0"], "must be >= 1"), (["--lr", "0"], "--lr"),
                                        (["--out", str(SHIPPED_DIR / "target.npz")], "shipped with minillm")])
def test_command_refuses_bad_options_before_any_work(argv, match, tmp_path):
    """medusa-train checks its options before it loads a model or writes anything."""
    import argparse

    from minillm.tools.medusa_cli import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "h.npz"), "--model", "no-such-model", *argv])
    with pytest.raises(ValueError, match=match):
        run(args)
    assert list(tmp_path.iterdir()) == []


def test_shipped_smollm2_heads_name_their_gguf_and_refuse_another_model():
    """The SmolLM2 heads (float16 residual blocks, < 3 MB) name the GGUF file they were trained on
    and refuse to load onto the character model."""
    from minillm.checkpoint import load_model, model_notes
    from minillm.registry import SMOLLM2, SMOLLM2_SHA256

    path = shipped_heads_path(SMOLLM2)
    assert path.stat().st_size < 3e6 and model_notes(path)["gguf_sha256"] == SMOLLM2_SHA256
    with pytest.raises(ValueError, match="another model"):
        MedusaHeads.load(load_model("target")[0], path)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "8.1", "8.2", "8.3", "9.1", "9.2", "A1.3")
@pytest.mark.slow
def test_shipped_smollm2_heads_keep_greedy_output():
    """With SmolLM2 (about 10 s: loading the model dominates), greedy Medusa decoding of a short chat
    answer with the shipped heads (4, sharing the LM head) is the model's own greedy answer."""
    from test_bpe import smollm2_gguf

    from minillm.registry import SMOLLM2, load_model

    smollm2_gguf()  # skips when the model package is not installed
    model, tok = load_model(SMOLLM2)
    heads = MedusaHeads.load(model, shipped_heads_path(SMOLLM2))
    assert heads.n_heads == 4 and heads.shared_lm_head
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    cache = KVCache(model.config, max_len=len(prompt) + 32)
    ref = generate(model, prompt, 12, temperature=0, cache=cache).tokens
    assert tree_generate(model, prompt, 12, MedusaProposer(heads), temperature=0, cache=cache).tokens == ref
