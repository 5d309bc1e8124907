"""Training: the hand-written backward pass, AdamW, the schedule, and exact resume."""

import json

import numpy as np
import pytest

from minillm import GPT, GPTConfig, checkpoint, load_model
from minillm import train as tr
from minillm.backend import to_numpy, xp

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)



def float64_params(seed=0):
    """The tiny model's parameters in float64, perturbed, as the backend's arrays."""
    rng = np.random.default_rng(seed)
    base = GPT.init(CFG, seed=seed).numpy_params()
    return {k: xp.asarray(v.astype(np.float64) + rng.normal(0, 0.1, v.shape)) for k, v in base.items()}


def max_gradcheck_error(params, idx, targets, entries_per_tensor=12, eps=1e-6):
    """Largest relative error between analytic and central-difference gradients over a sample of
    entries of every parameter tensor: |num - ana| / max(|num| + |ana|, 1e-8)."""
    _, grads = tr.forward_backward(params, CFG, idx, targets)
    rng = np.random.default_rng(1)
    worst = {}
    for name, p in params.items():
        flat, g = p.reshape(-1), to_numpy(grads[name]).reshape(-1)  # flat: a view, perturbed in place
        errs = []
        for j in rng.choice(flat.size, size=min(entries_per_tensor, flat.size), replace=False):
            old = flat[j].copy()  # on a device, flat[j] is a view
            flat[j] = old + eps
            lp, _ = tr.forward_backward(params, CFG, idx, targets)
            flat[j] = old - eps
            lm, _ = tr.forward_backward(params, CFG, idx, targets)
            flat[j] = old
            num = float(lp - lm) / (2 * eps)
            errs.append(abs(num - g[j]) / max(abs(num) + abs(g[j]), 1e-8))
        worst[name] = max(errs)
    return worst


@pytest.fixture
def batch():
    """(inputs, targets) (2, 8) on the device, as train.get_batch gives them."""
    rng = np.random.default_rng(0)
    return xp.asarray(rng.integers(0, 11, (2, 8))), xp.asarray(rng.integers(0, 11, (2, 8)))


def numerical_grad(f, x, dout, eps=1e-6):
    """Central differences of sum(f(x) * dout) with respect to every entry of x (the backend's arrays
    in, a host NumPy array out)."""
    g = np.zeros(x.shape)
    for i in np.ndindex(x.shape):
        old = x[i].copy()  # on a device, x[i] is a view
        x[i] = old + eps
        up = float((f(x) * dout).sum())
        x[i] = old - eps
        down = float((f(x) * dout).sum())
        x[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


@pytest.mark.exercise("A1.1")
def test_gelu_backward_matches_finite_differences():
    """gelu_backward(dout, x) == d/dx sum(gelu(x) * dout), float64, at negative, zero and large x."""
    rng = np.random.default_rng(0)
    x = xp.asarray(np.r_[rng.normal(size=20) * 3, 0.0, -8.0, 8.0])
    dout = xp.asarray(rng.normal(size=x.shape))
    np.testing.assert_allclose(to_numpy(tr.gelu_backward(dout, x)), numerical_grad(tr.gelu, x, dout), atol=1e-8)


@pytest.mark.exercise("A1.2")
def test_layernorm_backward_matches_finite_differences():
    """layernorm_backward gives dx, dw, db of sum(layer_norm(x, w, b) * dout) (float64, (B, T, C))."""
    rng = np.random.default_rng(1)
    x, w, b = (xp.asarray(rng.normal(size=shape)) for shape in ((2, 3, 5), 5, 5))
    dout = xp.asarray(rng.normal(size=x.shape))
    dx, dw, db = map(to_numpy, tr.layernorm_backward(dout, x, w))
    np.testing.assert_allclose(dx, numerical_grad(lambda t: tr.layer_norm(t, w, b), x, dout), atol=1e-7)
    np.testing.assert_allclose(dw, numerical_grad(lambda t: tr.layer_norm(x, t, b), w.copy(), dout), atol=1e-7)
    np.testing.assert_allclose(db, numerical_grad(lambda t: tr.layer_norm(x, w, t), b.copy(), dout), atol=1e-7)


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_gradient_check_every_parameter(batch):
    """Every parameter tensor's gradient matches finite differences in float64 (rel err <= 1e-5)."""
    params = float64_params()
    worst = max_gradcheck_error(params, *batch)
    assert set(worst) == set(CFG.param_shapes())
    bad = {k: v for k, v in worst.items() if v > 1e-5}
    assert not bad, bad


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_gradient_check_catches_a_wrong_backward(batch, monkeypatch):
    """The check bites: LayerNorm backward without its mean-subtraction term is detected."""

    def wrong_layernorm_backward(dout, x, w):
        dx, dw, db = real(dout, x, w)
        return dx + dout.mean(axis=-1, keepdims=True) * w.mean(), dw, db

    real = tr.layernorm_backward
    monkeypatch.setattr(tr, "layernorm_backward", wrong_layernorm_backward)
    worst = max_gradcheck_error(float64_params(), *batch, entries_per_tensor=4)
    assert max(worst.values()) > 1e-3


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_loss_equals_model_forward(batch):
    """The training forward and GPT.forward compute the same loss."""
    params = {k: v.astype(np.float32) for k, v in float64_params().items()}
    loss, _ = tr.forward_backward(params, CFG, *batch)
    model_loss, _ = tr.cross_entropy_forward(GPT(CFG, params).forward(batch[0]), batch[1])
    assert abs(float(loss) - float(model_loss)) < 1e-5


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_float32_training_stays_float32(batch):
    model = GPT.init(CFG)
    _, grads = tr.forward_backward(model.params, CFG, *batch)
    assert all(g.dtype == np.float32 for g in grads.values())


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_tiny_model_overfits_one_batch(batch):
    """200 AdamW steps on one batch drive the loss from ~2.4 (uniform over 11) to below 0.1."""
    model = GPT.init(CFG, seed=0)
    opt = tr.AdamW(model.params, weight_decay=0.0)
    first = None
    for _ in range(200):
        loss, grads = tr.forward_backward(model.params, CFG, *batch)
        first = first or loss
        opt.step(model.params, grads, lr=1e-2)
    assert first > 2.0 and loss < 0.1


@pytest.mark.exercise("A1.3")
def test_adamw_bias_corrected_steps():
    """Step 1 moves each parameter by lr * g / (|g| + eps) (the bias corrections undo the moments'
    zero start); step 2 by lr * m_hat / (sqrt(v_hat) + eps), computed here by hand. In place."""
    params = {"b": xp.asarray([1.0, 1.0, 1.0])}
    original = params["b"]
    opt = tr.AdamW(params, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    g1, g2 = np.array([0.5, -2.0, 1e-3]), np.array([-1.0, 1.0, 1.0])
    opt.step(params, {"b": xp.asarray(g1)}, lr=0.1)
    np.testing.assert_allclose(to_numpy(params["b"]), 1.0 - 0.1 * g1 / (np.abs(g1) + 1e-8))
    m = (0.9 * 0.1 * g1 + 0.1 * g2) / (1 - 0.9**2)
    v = (0.99 * 0.01 * g1**2 + 0.01 * g2**2) / (1 - 0.99**2)
    expected = 1.0 - 0.1 * g1 / (np.abs(g1) + 1e-8) - 0.1 * m / (np.sqrt(v) + 1e-8)
    opt.step(params, {"b": xp.asarray(g2)}, lr=0.1)
    np.testing.assert_allclose(to_numpy(params["b"]), expected)
    assert params["b"] is original


@pytest.mark.exercise("A1.3")
def test_adamw_decays_matrices_only():
    params = {"w": xp.ones((2, 2), np.float32), "b": xp.ones(2, np.float32)}
    opt = tr.AdamW(params, weight_decay=0.5)
    opt.step(params, {"w": xp.zeros((2, 2), np.float32), "b": xp.zeros(2, np.float32)}, lr=0.1)
    np.testing.assert_allclose(to_numpy(params["w"]), 0.95)
    np.testing.assert_allclose(to_numpy(params["b"]), 1.0)


def test_clip_grad_norm():
    grads = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}
    assert tr.clip_grad_norm(grads, 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(grads["a"], [0.6, 0.0])
    grads = {"a": np.array([0.3])}
    tr.clip_grad_norm(grads, 1.0)
    np.testing.assert_allclose(grads["a"], [0.3])


def test_schedule_warmup_then_cosine():
    tc = tr.TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert tr.lr_at(0, tc) == pytest.approx(0.1)
    assert tr.lr_at(9, tc) == pytest.approx(1.0)
    assert tr.lr_at(60, tc) == pytest.approx(0.55)
    assert tr.lr_at(110, tc) == pytest.approx(0.1)


def test_batches_are_seeded_and_shifted():
    data = np.arange(100, dtype=np.uint8)
    x1, y1 = tr.get_batch(data, 4, 8, np.random.default_rng(5))
    x2, _ = tr.get_batch(data, 4, 8, np.random.default_rng(5))
    np.testing.assert_array_equal(to_numpy(x1), to_numpy(x2))
    np.testing.assert_array_equal(to_numpy(y1)[:, :-1], to_numpy(x1)[:, 1:])


TINY_TRAIN = tr.TrainConfig(
    batch_size=2, max_steps=6, warmup_steps=2, eval_every=3, eval_batches=1, ckpt_every=3
)
TINY_MODEL = GPTConfig(vocab_size=84, block_size=16, n_layer=1, n_head=2, n_embd=16)


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_resume_continues_exactly(tmp_path, monkeypatch):
    """A run killed during step 5 and resumed from its step-3 checkpoint == an uninterrupted run:
    same loss at every step (same batches, same optimizer state), bit-identical final weights."""
    full = tr.train("draft", tmp_path / "full.npz", train_config=TINY_TRAIN, model_config=TINY_MODEL,
                    progress=False)
    real_clip, calls = tr.clip_grad_norm, []

    def dies_in_step_5(grads, max_norm):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt("killed")
        return real_clip(grads, max_norm)

    monkeypatch.setattr(tr, "clip_grad_norm", dies_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        tr.train("draft", tmp_path / "part.npz", train_config=TINY_TRAIN, model_config=TINY_MODEL,
                 progress=False)
    monkeypatch.setattr(tr, "clip_grad_norm", real_clip)
    resumed = tr.train("draft", tmp_path / "part.npz", resume=True, progress=False)
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in full["history"]]
    a, _ = load_model(tmp_path / "full.npz")
    b, _ = load_model(tmp_path / "part.npz")
    for name in a.params:
        np.testing.assert_array_equal(to_numpy(a.params[name]), to_numpy(b.params[name]))
    log = json.loads((tmp_path / "full.log.json").read_text())
    assert log["steps"] == 6 and "val_loss" in log


def test_resume_without_state_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="nothing.train.npz"):
        tr.train("draft", tmp_path / "nothing.npz", resume=True, progress=False)


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_never_overwrites_a_shipped_model_unless_asked(tmp_path, monkeypatch):
    """Training into a shipped model's path is refused before any work (the file untouched, no state
    written); with overwrite_shipped=True it is replaced, and the state and log go to the working
    directory, not into the package."""
    models, work = tmp_path / "package" / "models", tmp_path / "work"
    models.mkdir(parents=True)
    work.mkdir()
    monkeypatch.setattr(checkpoint, "SHIPPED_DIR", models)
    monkeypatch.setattr(tr, "SHIPPED_DIR", models)
    monkeypatch.chdir(work)
    shipped = models / "draft.npz"
    shipped.write_bytes(b"the shipped model")
    with pytest.raises(ValueError, match="shipped with minillm.*--overwrite-shipped"):
        tr.train("draft", shipped, train_config=TINY_TRAIN, model_config=TINY_MODEL, progress=False)
    assert shipped.read_bytes() == b"the shipped model" and sorted(p.name for p in models.iterdir()) == ["draft.npz"]

    tr.train("draft", shipped, train_config=TINY_TRAIN, model_config=TINY_MODEL, progress=False,
             overwrite_shipped=True)
    assert load_model(shipped)[0].config == TINY_MODEL
    assert sorted(p.name for p in models.iterdir()) == ["draft.npz"]
    assert sorted(p.name for p in work.iterdir()) == ["draft.log.json", "draft.train.npz"]


@pytest.mark.parametrize("steps", [0, -5])
def test_steps_below_one_are_refused_before_anything_is_written(tmp_path, steps):
    with pytest.raises(ValueError, match=f"steps must be >= 1, got {steps}"):
        tr.train("draft", tmp_path / "m.npz", steps=steps, train_config=TINY_TRAIN, model_config=TINY_MODEL,
                 progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_resuming_a_finished_run_is_refused(tmp_path):
    tr.train("draft", tmp_path / "m.npz", steps=3, train_config=TINY_TRAIN, model_config=TINY_MODEL, progress=False)
    with pytest.raises(ValueError, match="already at step 3 of 3"):
        tr.train("draft", tmp_path / "m.npz", steps=3, resume=True, progress=False)


def tiny_run(out, **kwargs):
    return tr.train("draft", out, **{"train_config": TINY_TRAIN, "model_config": TINY_MODEL, "progress": False}
                    | kwargs)


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_training_run_refuses_existing_files_unless_overwrite(tmp_path):
    """`train --out notes.txt` turned a text file into a model (and its sibling .train.npz and .log.json
    were replaced too): each existing file of the run is refused, untouched, unless overwrite=True."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(ValueError, match="notes.txt already exists: pass --overwrite"):
        tiny_run(notes)
    assert notes.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    (tmp_path / "m.log.json").write_text("{}")
    with pytest.raises(ValueError, match="m.log.json already exists"):
        tiny_run(tmp_path / "m.npz")
    tiny_run(tmp_path / "m.npz", overwrite=True)
    assert json.loads((tmp_path / "m.log.json").read_text())["steps"] == 6


def test_destination_is_checked_before_step_1(tmp_path, monkeypatch):
    """`--out` a directory failed only after training, a read-only folder at the first checkpoint:
    both are refused before any step runs."""
    def no_step(*args):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(tr, "forward_backward", no_step)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="folder is a directory"):
        tiny_run(tmp_path / "folder")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file is not a writable folder"):
        tiny_run(tmp_path / "file" / "m.npz")
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    if not checkpoint.os.access(readonly, checkpoint.os.W_OK):  # root may write anywhere
        with pytest.raises(ValueError, match="readonly is not a writable folder"):
            tiny_run(readonly / "m.npz")


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_training_run_stops_on_divergence_and_writes_no_model(tmp_path):
    """lr 1e4 diverged and the run wrote a model of NaN weights without a word: it stops at the first
    non-finite loss or gradient norm, saying so, and writes nothing from that step on."""
    from dataclasses import replace

    with pytest.raises(ValueError, match="training diverged at step"):
        tiny_run(tmp_path / "m.npz", train_config=replace(TINY_TRAIN, lr=1e4, warmup_steps=1, max_steps=40,
                                                          ckpt_every=40, eval_every=40))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_training_run_resume_finishes_a_crashed_export(tmp_path, monkeypatch):
    """A crash after the last checkpoint, in the final validation and export, could never be resumed
    ("already at step 6 of 6: nothing to train", no model): --resume writes the model; after that,
    resuming again has nothing to do."""
    real_export = tr.export

    def crashes(*args):
        raise KeyboardInterrupt("killed in the export")

    monkeypatch.setattr(tr, "export", crashes)
    with pytest.raises(KeyboardInterrupt):
        tiny_run(tmp_path / "m.npz")
    assert not (tmp_path / "m.npz").exists() and (tmp_path / "m.train.npz").exists()
    monkeypatch.setattr(tr, "export", real_export)
    summary = tr.train("draft", tmp_path / "m.npz", resume=True, progress=False)
    assert summary["steps"] == 6 and load_model(tmp_path / "m.npz")[0].config == TINY_MODEL
    with pytest.raises(ValueError, match="already at step 6 of 6"):
        tr.train("draft", tmp_path / "m.npz", resume=True, progress=False)


def test_resume_from_a_model_file_is_one_line(tmp_path, tiny_model):
    """--resume with a model where the training state should be raised KeyError 'train_config'."""
    from minillm import CharTokenizer, save_model

    save_model(tmp_path / "m.train.npz", tiny_model, CharTokenizer("abcdefghijklm"))
    with pytest.raises(checkpoint.CheckpointError, match="m.train.npz is not a training state"):
        tr.train("draft", tmp_path / "m.npz", resume=True, progress=False)


@pytest.mark.uses_exercise("A1.1", "A1.2", "A1.3")
def test_training_run_removes_its_stale_temp_files(tmp_path):
    """kill -9 during a checkpoint write left m.train.npz.<8 chars>.tmp behind for good: the next run
    of that destination removes them (and nothing else)."""
    (tmp_path / "m.train.npz.k1ll3d_9.tmp").write_text("half a checkpoint")
    (tmp_path / "keep.tmp").write_text("not ours")
    tiny_run(tmp_path / "m.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.tmp", "m.log.json", "m.npz", "m.train.npz"]
