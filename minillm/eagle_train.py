"""Training an EAGLE draft (``minillm.eagle``) on the frozen target: data, backward pass, loop.

Data (``write_answers``): the target answers training prompts (``minillm.workloads``) with its chat
template, greedy and sampled, B prompts of one length at a time in one batched cache; every forward
also gives the target's final hidden state at each token, so one pass yields the text the target
writes AND the features the draft must predict (at prompt positions: the text it reads, teacher
forced). Fixed conversations (a question and an answer the target did not write) are read the
same way with one new token: the target's features on text it did not write, a prefill each, as
EAGLE trains on fixed data. The answers go to part files, one per batch, written atomically: a
stopped run ``--resume``s at the first missing part.

Loss, per position t of a training window (input: the target's feature f_t and token x_{t+1}):

    L = CE(draft logits over the subset, x_{t+2})  +  FEATURE_WEIGHT * SmoothL1(f^_{t+1}, f_{t+1})

(EAGLE's two terms; a target token outside the subset has no CE term: the draft cannot propose it.)
The backward pass of the draft's decoder layer (RMSNorm, RoPE, grouped-query attention, SwiGLU) is
written here in the style of ``minillm.train``'s for GPT, and checked by finite differences in
``tests/test_eagle.py``.

    python -m minillm eagle-data --out DIR [--prompts 1200] [--resume]
    python -m minillm eagle-train --data DIR --out eagle.npz [--steps N] [--resume]
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from .backend import to_numpy, xp
from .checkpoint import (
    FLOAT_WEIGHTS,
    HEADER_KEY,
    TOKEN_IDS,
    CheckpointError,
    atomic_save_npz,
    check_format,
    check_trained_for,
    encode_header,
    model_identity,
    read_npz,
)
from .eagle import check_tap_layers
from .kv_cache import KVCache
from .llama import LlamaOps, grouped_attention, llama_blocks, stacked_weights
from .nn import merge_heads, silu, split_heads
from .sampling import SamplingSettings, sample
from .train import (
    AdamW,
    Recording,
    TrainConfig,
    attention_backward,
    check_step,
    clip_grad_norm,
    cross_entropy_backward,
    cross_entropy_forward,
    lr_at,
)

DATA_FORMAT = "minillm-eagle-data-2"
DATA_KIND = "EAGLE data part"
DATA_COMMAND = "python -m minillm eagle-data --model MODEL --out DIR"
TEMPERATURES = (0.0, 0.7, 1.0)  # prompt i is answered at TEMPERATURES[i % 3]
ANSWER_TOKENS = 96  # the most tokens of one answer
DATA_BATCH = 32  # answers decoded together (prompts of one temperature and about one length)
MAX_PAD = 6  # the most newlines a prompt gets to match its batch's length
MAX_DATA_BATCH = 256  # the most answers one part may hold
TAP_LAYERS = (2, 15)  # EAGLE-3 reads the input of block 2 and of block n_layer // 2 beside the top
PART_NAME = re.compile(r"part-(\d{5})\.npz")  # part g is part-{g:05d}.npz


# ----------------------------------------------------------------------------------------------
# data: the target's answers and its hidden states


def answer_batches(prompt_ids: list, temperatures: list, batch: int) -> list[list[int]]:
    """Prompt indices grouped by temperature, by length within it: at most ``batch`` per group, and
    lengths at most MAX_PAD apart (``pad_prompts`` evens them out)."""
    keys = sorted(range(len(prompt_ids)), key=lambda i: (temperatures[i], len(prompt_ids[i]), i))
    groups, current = [], []
    for i in keys:
        if current and (len(current) == batch or temperatures[i] != temperatures[current[0]]
                        or len(prompt_ids[i]) - len(prompt_ids[current[0]]) > MAX_PAD):
            groups.append(current)
            current = []
        current.append(i)
    return groups + [current] if current else groups


def pad_prompts(prompt_ids: list, at: int, pad_id: int) -> list[list[int]]:
    """Make a batch's prompts one length: insert pad_id tokens at position ``at`` of the shorter ones.

    A batch shares one cache, so its rows need equal lengths; the chat template's header (every
    prompt's common prefix) is followed by up to a few extra newlines before the user's text.
    """
    n = max(len(p) for p in prompt_ids)
    return [[*p[:at], *[pad_id] * (n - len(p)), *p[at:]] for p in prompt_ids]


def answer_batch(model, prompt_ids: list, max_new_tokens: int, temperature: float, eos: int, seed: int):
    """B prompts of one length -> [(tokens, features)]: prompt + answer (cut after eos), and the
    target's final hidden state (n - 1, C) float16 after each token but the last."""
    B, L = len(prompt_ids), len(prompt_ids[0])
    cache = KVCache(model.config, batch_size=B, max_len=L + max_new_tokens)
    settings = SamplingSettings(temperature)
    rngs = [np.random.default_rng([seed, b]) for b in range(B)]
    h = model.hidden(np.asarray(prompt_ids), cache)  # (B, L, C)
    feats, tokens = [to_numpy(h).astype(np.float16)], [list(p) for p in prompt_ids]
    done = np.zeros(B, dtype=bool)
    for step in range(max_new_tokens):
        probs = settings.probs(to_numpy(model.logits(h[:, -1])))  # (B, V)
        nxt = [int(np.argmax(p)) if settings.greedy else sample(p, rngs[b]) for b, p in enumerate(probs)]
        for b in range(B):
            if not done[b]:
                tokens[b].append(nxt[b])
                done[b] = nxt[b] == eos
        if done.all() or step == max_new_tokens - 1:
            break
        h = model.hidden(np.asarray(nxt)[:, None], cache)  # (B, 1, C)
        feats.append(to_numpy(h).astype(np.float16))
    feats = np.concatenate(feats, axis=1)  # (B, L + steps, C)
    return [(np.asarray(t, dtype=np.int32), feats[b, : len(t) - 1]) for b, t in enumerate(tokens)]


def data_arguments(prompts: list, max_new_tokens: int, batch: int, seed: int) -> dict:
    """What a data folder is written from: every part records it, and ``resume`` must find the same."""
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()
    return {"prompts": len(prompts), "prompts_sha256": digest, "max_new_tokens": int(max_new_tokens),
            "batch": int(batch), "seed": int(seed)}


def data_parts(data_dir) -> dict:
    """{g: path} of the part files in ``data_dir`` (names part-00000.npz, ...; other files are not ours)."""
    found = (PART_NAME.fullmatch(p.name) for p in Path(data_dir).iterdir()) if Path(data_dir).is_dir() else ()
    return {int(m.group(1)): Path(data_dir) / m.group(0) for m in found if m}


def write_answers(model, tokenizer, prompts: list, out_dir, max_new_tokens: int = ANSWER_TOKENS,
                  batch: int = DATA_BATCH, seed: int = 0, resume: bool = False, progress: bool = True) -> dict:
    """The target's answers to ``prompts`` ({"prompt", "kind"}) -> part files in out_dir; a summary. A prompt
    with an "answer" (``workloads.stdlib_texts``) gets that fixed text as the start of its answer, read
    teacher-forced, then ``max_new_tokens`` of the target's own.

    Each part (one batch) holds ids and features (sum(n - 1), C) float16; its header the answers'
    lengths, prompt lengths, kinds and temperature, the target's identity and the arguments of the
    run (``data_arguments``). With ``resume`` the parts already there are kept and the rest written:
    pass 1 checks every part there, whole (``read_part``), and refuses one written with other
    arguments or for another model; pass 2 writes the missing ones.
    """
    from tqdm import tqdm

    if not 1 <= batch <= MAX_DATA_BATCH or max_new_tokens < 1:
        raise ValueError(f"batch must be in 1..{MAX_DATA_BATCH} and max_new_tokens >= 1, got {batch}, {max_new_tokens}")
    out_dir = Path(out_dir)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}])
                            + p.get("answer", "")) for p in prompts]
    temps = [TEMPERATURES[i % len(TEMPERATURES)] for i in range(len(prompts))]
    groups = answer_batches(ids, temps, batch)
    header_len = len(os.path.commonprefix(ids))  # the chat template's system turn and "user\n"
    newline = tokenizer.encode("\n")[-1]
    arguments = data_arguments(prompts, max_new_tokens, batch, seed)
    existing = data_parts(out_dir)
    if existing and not resume:
        raise ValueError(f"{out_dir} already holds {len(existing)} data parts: pass --resume to continue "
                         f"them, or choose another --out")
    for g, path in sorted(existing.items()):  # pass 1: what is there belongs to this run, whole
        read_part(path, model, arguments, g)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, written = time.perf_counter(), 0
    for g, group in enumerate(tqdm(groups, desc="eagle data", disable=not progress)):  # pass 2: the rest
        if g in existing:
            continue
        padded = pad_prompts([ids[i] for i in group], header_len, newline)
        rows = answer_batch(model, padded, max_new_tokens, temps[group[0]], tokenizer.eos_token_id, seed + g)
        header = {"format": DATA_FORMAT, "model": model_identity(model), "arguments": arguments, "part": g,
                  "parts": len(groups), "prompts": group, "kinds": [prompts[i]["kind"] for i in group],
                  "temperature": temps[group[0]], "prompt_lengths": [len(padded[0])] * len(group),
                  "lengths": [len(r[0]) for r in rows]}
        arrays = {"ids": np.concatenate([r[0] for r in rows]), "features": np.concatenate([r[1] for r in rows])}
        atomic_save_npz(out_dir / f"part-{g:05d}.npz", arrays | {HEADER_KEY: encode_header(header)})
        written += sum(header["lengths"])
    return {"parts": len(groups), "tokens_written": written, "seconds": round(time.perf_counter() - t0, 1)}


def header_ints(header: dict, key: str, n: int, low: int, high, path) -> list:
    """``header[key]``: a list of ``n`` ints in low..high (high: one bound per entry, or one for all);
    CheckpointError otherwise."""
    values, highs = header.get(key), high if isinstance(high, list) else [high] * n
    if not isinstance(values, list) or len(values) != n or not all(
            isinstance(v, int) and not isinstance(v, bool) and low <= v <= h for v, h in zip(values, highs)):
        raise CheckpointError(f"inconsistent {DATA_KIND} {path}: {key} must be {n} ints in {low}..{max(highs)}, "
                              f"got {str(values)[:80]}")
    return values


def part_layout(header: dict, model, path, arguments=None, index=None) -> dict:
    """The arrays a data part's header implies for ``model``: {name: (shape, dtypes)}, once the header is
    checked: its format, the model that wrote it, the run's arguments and its part number (when
    given), and answers that fit the model (lengths 2..block_size, each with a prompt and an answer)."""
    check_format(header, DATA_FORMAT, path, DATA_KIND)
    check_trained_for(header, model, path, DATA_KIND, DATA_COMMAND, made="written by")
    if arguments is not None and header.get("arguments") != arguments:
        saved = header.get("arguments") if isinstance(header.get("arguments"), dict) else {}
        what = ", ".join(f"{k} {saved.get(k)!r} vs {v!r}" for k, v in arguments.items() if saved.get(k) != v)
        raise CheckpointError(f"{path} was written with other arguments ({what[:200]}): resume with the "
                              "arguments it was written with, or write to another --out")
    if index is not None and header.get("part") != index:
        raise CheckpointError(f"inconsistent {DATA_KIND} {path}: its header says part {header.get('part')!r}")
    if header.get("temperature") not in TEMPERATURES:
        raise CheckpointError(f"inconsistent {DATA_KIND} {path}: temperature {header.get('temperature')!r}")
    n = len(header["lengths"]) if isinstance(header.get("lengths"), list) else 0
    if not 1 <= n <= MAX_DATA_BATCH:
        raise CheckpointError(f"inconsistent {DATA_KIND} {path}: lengths must list 1..{MAX_DATA_BATCH} answers")
    lengths = header_ints(header, "lengths", n, 2, model.config.block_size, path)
    header_ints(header, "prompt_lengths", n, 1, [length - 1 for length in lengths], path)
    if not isinstance(header.get("kinds"), list) or len(header["kinds"]) != n:
        raise CheckpointError(f"inconsistent {DATA_KIND} {path}: kinds must list {n} answers")
    return {"ids": ((sum(lengths),), TOKEN_IDS), "features": ((sum(lengths) - n, model.config.n_embd), FLOAT_WEIGHTS)}


def read_part(path, model, arguments=None, index=None) -> tuple[dict, dict]:
    """One data part, checked whole before it is used (``part_layout``, then every array read, its token
    ids in the model's vocabulary, its features finite) -> (header, arrays); CheckpointError otherwise."""
    header, arrays = read_npz(path, lambda header: part_layout(header, model, path, arguments, index), DATA_KIND)
    if arrays["ids"].min() < 0 or arrays["ids"].max() >= model.config.vocab_size:
        raise CheckpointError(f"inconsistent {DATA_KIND} {path}: token ids outside 0..{model.config.vocab_size - 1}")
    return header, arrays


def read_answers(data_dirs, model, max_parts=None, taps_dirs=None, tap_layers=TAP_LAYERS) -> dict:
    """``write_answers``' parts for ``model`` in one folder or several (the first ``max_parts`` of each: one
    number for every folder, or one per folder; all by default) -> {"sequences": [ids], "features":
    [(n - 1, C) float16], "kinds", "temperatures", "prompt_lengths", "parts"}, folder after folder, in part
    order (``read_folder``). ``taps_dirs`` (one per data folder, ``write_taps``): each feature row becomes
    [the taps at ``tap_layers``; f] ((n - 1, (len(tap_layers) + 1) C)), EAGLE-3's input."""
    dirs = [data_dirs] if isinstance(data_dirs, (str, os.PathLike)) else list(data_dirs)
    if not dirs:
        raise ValueError("no EAGLE data folder given")
    limits = list(max_parts) if isinstance(max_parts, (list, tuple)) else [max_parts]
    if len(limits) == 1:
        limits *= len(dirs)
    if len(limits) != len(dirs):
        raise ValueError(f"{len(limits)} part counts for {len(dirs)} data folders: give one, or one per folder")
    taps = [None] * len(dirs) if taps_dirs is None else list(taps_dirs)
    if len(taps) != len(dirs):
        raise ValueError(f"{len(taps)} taps folders for {len(dirs)} data folders: give one per data folder")
    out = {"sequences": [], "features": [], "kinds": [], "temperatures": [], "prompt_lengths": [], "parts": 0}
    for data_dir, limit, taps_dir in zip(dirs, limits, taps):
        for key, value in read_folder(data_dir, model, limit, taps_dir, tap_layers).items():
            out[key] += value
    return out


def read_folder(data_dir, model, max_parts: int | None = None, taps_dir=None, tap_layers=TAP_LAYERS) -> dict:
    """One folder of ``read_answers``. Every part read is checked whole (``read_part``), all must come from
    one run (part 0's arguments), and none may be missing: a folder that eagle-data has not finished is
    refused; so is a taps folder that lacks one of its parts."""
    if max_parts is not None and max_parts < 1:
        raise ValueError(f"the number of data parts to read must be >= 1, got {max_parts}")
    found = data_parts(data_dir)
    if 0 not in found:
        raise ValueError(f"{data_dir} holds no EAGLE data parts (part-00000.npz): run {DATA_COMMAND}")
    header, _ = read_part(found[0], model, index=0)
    arguments, n_parts = header["arguments"], header.get("parts")
    if not isinstance(n_parts, int) or max(found) >= n_parts:
        raise CheckpointError(f"inconsistent EAGLE data in {data_dir}: part-00000.npz says {n_parts!r} parts, "
                              f"the folder holds part {max(found)}")
    wanted = range(n_parts if max_parts is None else min(max_parts, n_parts))
    missing = [g for g in wanted if g not in found]
    if missing:
        raise ValueError(f"{data_dir} lacks part-{missing[0]:05d}.npz ({len(missing)} of {n_parts} parts missing): "
                         "finish it with eagle-data --resume and the arguments it was written with")
    taps = {} if taps_dir is None else data_parts(taps_dir)
    tap_layers = check_tap_layers(model.config, tap_layers) if taps_dir is not None else ()
    if taps_dir is not None and any(g not in taps for g in wanted):
        raise ValueError(f"{taps_dir} lacks taps parts of {data_dir}: finish it with eagle-taps --resume")
    out = {"sequences": [], "features": [], "kinds": [], "temperatures": [], "prompt_lengths": [],
           "parts": len(wanted)}
    for g in wanted:
        header, arrays = read_part(found[g], model, arguments, g)
        lengths = np.asarray(header["lengths"])
        features = arrays["features"]
        if taps_dir is not None:
            low = read_taps(taps[g], model, header["lengths"], tap_layers, g)
            features = np.concatenate([low.reshape(len(low), -1), features], axis=1)
        out["sequences"] += np.split(arrays["ids"], np.cumsum(lengths)[:-1])
        out["features"] += np.split(features, np.cumsum(lengths - 1)[:-1])
        out["kinds"] += header["kinds"]
        out["temperatures"] += [header["temperature"]] * len(lengths)
        out["prompt_lengths"] += header["prompt_lengths"]
    return out


# ----------------------------------------------------------------------------------------------
# EAGLE-3's lower features: the input of a low and a middle block at every position of each answer

TAPS_FORMAT = "minillm-eagle-taps-1"
TAPS_KIND = "EAGLE taps part"


def tap_rows(model, ids, layers) -> np.ndarray:
    """One answer's ids (n,) -> (n - 1, len(layers), C) float16: the input of each block in ``layers`` at every
    position but the last, RMS-normed as that block reads it (its input_layernorm), by one prefill."""
    taps = model.hidden_taps(np.asarray(ids[:-1])[None], tap_layers=layers, layers=max(layers) + 1)[1]
    return np.stack([to_numpy(t)[0] for t in taps], axis=1).astype(np.float16)


def write_taps(model, data_dir, out_dir, layers=TAP_LAYERS, resume: bool = False, progress: bool = True) -> dict:
    """For every part of an eagle-data folder, the same answers' features at ``layers`` (``tap_rows``) -> a part
    file of the same number in out_dir: "taps" (sum(n - 1), len(layers), C) float16, its header the source part's
    answer lengths and the tap layers (``read_taps`` checks both). ``resume`` keeps the parts already there."""
    from tqdm import tqdm

    layers = check_tap_layers(model.config, layers)
    found, existing = data_parts(data_dir), data_parts(out_dir)
    if 0 not in found:
        raise ValueError(f"{data_dir} holds no EAGLE data parts (part-00000.npz): run {DATA_COMMAND}")
    if existing and not resume:
        raise ValueError(f"{out_dir} already holds {len(existing)} taps parts: pass --resume to continue them, "
                         "or choose another --out")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    t0, written = time.perf_counter(), 0
    for g, path in tqdm(sorted(found.items()), desc="eagle taps", disable=not progress):
        header, arrays = read_part(path, model, index=g)
        if g in existing:
            read_taps(existing[g], model, header["lengths"], layers, g)  # it belongs to this folder, whole
            continue
        lengths = np.asarray(header["lengths"])
        rows = [tap_rows(model, ids, layers) for ids in np.split(arrays["ids"], np.cumsum(lengths)[:-1])]
        meta = {"format": TAPS_FORMAT, "model": model_identity(model), "part": g, "layers": list(layers),
                "lengths": header["lengths"]}
        atomic_save_npz(Path(out_dir) / f"part-{g:05d}.npz", {"taps": np.concatenate(rows),
                                                               HEADER_KEY: encode_header(meta)})
        written += int(lengths.sum())
    return {"parts": len(found), "tokens_written": written, "seconds": round(time.perf_counter() - t0, 1)}


def read_taps(path, model, lengths, layers, index) -> np.ndarray:
    """A ``write_taps`` part for the data part of ``lengths`` -> taps (sum(n - 1), len(layers), C) float16;
    CheckpointError (one line) for another model, part, layers or answers."""
    def layout(header):
        check_format(header, TAPS_FORMAT, path, TAPS_KIND)
        check_trained_for(header, model, path, TAPS_KIND, "python -m minillm eagle-taps --data DIR --out TAPS",
                          made="written by")
        for key, want in (("part", index), ("layers", list(layers)), ("lengths", list(lengths))):
            if header.get(key) != want:
                raise CheckpointError(f"{path} does not match its data part: its {key} differ (write it again with "
                                      "eagle-taps)")
        return {"taps": ((sum(lengths) - len(lengths), len(layers), model.config.n_embd), FLOAT_WEIGHTS)}

    return read_npz(path, layout, TAPS_KIND)[1]["taps"]


# ----------------------------------------------------------------------------------------------
# the draft layer's forward with its activations, and the backward pass

FEATURE_WEIGHT = 1.0  # EAGLE's weight of the feature regression beside the token loss (its w_reg)
HUBER_DELTA = 1.0  # SmoothL1's switch from quadratic to linear
DRAFT_LAYERS = 1  # the draft is one decoder layer of the target's shape (``eagle.EagleDraft``)


def rms_norm_backward(dy, x, w, eps: float):
    """forward: y = x r w, r = 1 / sqrt(mean(x^2) + eps).  -> dx, dw (summed over rows)

    dy/dx is r w - x r^3 (x w) / C for each row: dx = r (dy w) - x r^3 mean(dy w x).
    """
    # EXERCISE 11.1 BEGIN: the gradient through r too (not only r w); dw sums dy x r over every row
    r = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    dxhat = dy * w
    dx = r * dxhat - x * r**3 * (dxhat * x).mean(axis=-1, keepdims=True)
    return dx, (dy * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    # EXERCISE 11.1 END


def rope_backward(dy, cos, sin):
    """forward: y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1).  -> dx

    rotate_half is a rotation by 90 degrees; its transpose is (x1, x2) -> (x2, -x1).
    """
    # EXERCISE 11.2 BEGIN: dy cos plus the transposed rotation of dy sin: (g1, g2) -> (g2, -g1)
    g = dy * sin
    half = g.shape[-1] // 2
    return dy * cos + xp.concatenate([g[..., half:], -g[..., :half]], axis=-1)
    # EXERCISE 11.2 END


def silu_grad(x):
    """d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x) as ``llama.silu`` computes it."""
    s = 0.5 + 0.5 * xp.tanh(0.5 * x)
    return s * (1.0 + x * (1.0 - s))


def smooth_l1(x, y, delta: float = HUBER_DELTA):
    """mean over elements of SmoothL1(x - y) (Huber with slope 1) -> (loss, d loss / d x)."""
    d = x - y
    a = xp.abs(d)
    loss = xp.where(a < delta, 0.5 * d * d / delta, a - 0.5 * delta)
    return float(loss.mean()), xp.clip(d / delta, -1.0, 1.0) / d.size


class LlamaRecording(Recording):
    """The draft's Llama block on the tape (``train.Recording``): RMSNorm, SwiGLU, RoPE and grouped-query
    attention going back. The products that read stacked weights (q|k|v, gate|up) split their gradient
    into each weight's rows."""

    def __init__(self, config, params: dict):
        stacked = stacked_weights(params, DRAFT_LAYERS, lambda p, names: xp.concatenate([p[n] for n in names], axis=0))
        super().__init__(LlamaOps(config, params, None, stacked))
        self.rows = {name: [(n, params[n].shape[0]) for n in names]  # stacked product -> (weight, its rows)
                     for name, names in stacked_names(DRAFT_LAYERS).items()}
        self.table.attention = grouped_attention(self.attention, config.n_head // config.n_kv_head)

    def rope(self, pos):
        """RoPE's tables in the parameters' dtype (float64 for a gradient check), kept for the backward."""
        dtype = self.table.params["norm.weight"].dtype
        self.cos_sin = tuple(t.astype(dtype) for t in self.table.rope(pos))
        return self.cos_sin

    def norm_backward(self, d, x, name, grads):
        cfg = self.table.config
        dx, grads[name + ".weight"] = rms_norm_backward(d, x, self.table.params[name + ".weight"], cfg.norm_eps)
        return dx

    def weight_grads(self, grads, name, dw, db):
        """dw [in, out] -> each [out, in] weight's gradient (its rows of a stacked product)."""
        start = 0
        for param, rows in self.rows.get(name, [(name + ".weight", dw.shape[1])]):
            grads[param] = dw[:, start : start + rows].T
            start += rows

    def act_backward(self, d, gate_up):
        """forward: a = silu(g) * u, (g | u) the two halves of gate_up.  -> d (g | u)"""
        g, up = xp.split(gate_up, 2, axis=-1)
        return xp.concatenate([d * up * silu_grad(g), d * silu(g)], axis=-1)

    def attend_backward(self, dy, q, kr, vr, att):
        """(B, T, C) merged heads -> (B, T, q_dim + 2 kv_dim): d q | d k | d v, back through RoPE and the
        head repeat (each KV head served n_head / n_kv_head query heads)."""
        cfg = self.table.config
        B, nh, T, hs = q.shape
        nkv = cfg.n_kv_head
        dq, dkr, dvr = attention_backward(split_heads(dy, nh), q, kr, vr, att)
        dkr, dvr = dkr[:, :, -T:], dvr[:, :, -T:]  # the keys before a step's own (``AheadContext``) stay fixed
        dk = dkr.reshape(B, nkv, nh // nkv, T, hs).sum(axis=2)
        dv = dvr.reshape(B, nkv, nh // nkv, T, hs).sum(axis=2)
        cos, sin = self.cos_sin
        dq, dk = rope_backward(dq, cos, sin), rope_backward(dk, cos, sin)
        return xp.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)


def stacked_names(n_layer: int) -> dict:
    """{stacked product: the weights it reads, in row order}, as ``llama.stacked_weights`` stacks them."""
    return stacked_weights({}, n_layer, lambda params, names: names)


class AheadContext:
    """The keys and values of a training-time test's earlier steps (EAGLE-3), read by its later ones.

    Drafting, the draft's s-th guess of a round from position t sits at position t + s - 1: it reads its
    own feature f^ from the guess before, and attends to the cache of positions 0..t-1 (written from the
    target's features), to the first guess's entry at t and to each later guess's entry of this round.
    Training the same way, step 1 runs the window causally (row i at position i) and step s's row i (at
    position i + s - 1) attends to step 1's keys 0..i and to row i's keys of steps 2..s. ``advance``
    counts the steps; the gradient stops at earlier steps' keys and features (each step's backward
    reaches its own). Also a cache for ``EagleDraft.step``: the same guesses from the inference layer.
    """

    def __init__(self):
        self.steps, self.keys = 0, {}  # layer -> [(k, v) of each step so far]

    def positions(self, T: int):
        return xp.arange(self.steps, self.steps + T)

    def advance(self, T: int) -> None:
        self.steps += 1

    def attend(self, layer: int, q, k, v, attention):
        kv = self.keys.setdefault(layer, [])
        kv.append((k, v))
        if len(kv) == 1:
            return attention(q, k, v, causal=True)
        R = q.shape[2]  # step s has T - s + 1 rows
        mask = self.mask(R, kv[0][0].shape[2], len(kv))
        keys = xp.concatenate([kv[0][0]] + [k_[:, :, :R] for k_, _ in kv[1:]], axis=2)
        values = xp.concatenate([kv[0][1]] + [v_[:, :, :R] for _, v_ in kv[1:]], axis=2)
        return attention(q, keys, values, mask=mask)

    @staticmethod
    def mask(R: int, T: int, step: int):
        """Step ``step``'s R rows over step 1's T keys, then R keys of each step 2..step: row i sees step 1's
        keys 0..i (positions up to its round's first guess) and its own round's key of every later step."""
        return np.concatenate([np.tri(R, T, dtype=bool)] + [np.eye(R, dtype=bool)] * (step - 1), axis=1)


def draft_step_loss(params: dict, config, embed, lm_subset, feats, next_tokens, next_feats, targets,
                    context: AheadContext, feature_weight: float = FEATURE_WEIGHT):
    """One step of ``draft_forward_backward`` at the positions ``context`` gives it
    -> (loss, {"token", "feature"}, grads, f^ (B, T, C)). feats wider than C are the target's [taps; f],
    fused to C by params["fuse.weight"] first (EAGLE-3); a later step's f^ is read as it is."""
    B, T, C = next_feats.shape
    fused = feats.shape[-1] != C
    # forward: the input projection, then the Llama block itself, recorded
    g = feats @ params["fuse.weight"].T if fused else feats  # (B, T, C)
    a = xp.concatenate([embed[next_tokens], g], axis=-1)  # (B, T, 2C)
    u = a @ params["fc.weight"].T  # (B, T, C)
    tape = LlamaRecording(config, params)
    f_hat = llama_blocks(tape, u, context.positions(T), context, DRAFT_LAYERS)  # (B, T, C)
    context.advance(T)
    # the two losses
    rows = xp.nonzero(targets.reshape(-1) >= 0)[0]
    logits = f_hat.reshape(-1, C)[rows] @ lm_subset.T  # (N, V')
    ce, probs = cross_entropy_forward(logits, targets.reshape(-1)[rows])
    feat_loss, dfeat = smooth_l1(f_hat, next_feats)
    dlogits = cross_entropy_backward(probs, targets.reshape(-1)[rows])  # (N, V')
    df = (feature_weight * dfeat).reshape(-1, C)
    df[rows] += dlogits @ lm_subset
    # backward: the tape in reverse, then the input projection
    du, grads = tape.backward(df.reshape(B, T, C))
    grads["fc.weight"] = du.reshape(-1, C).T @ a.reshape(-1, 2 * C)
    if "fuse.weight" in params:  # d g = the feature half of du fc; a later step leaves the fuse alone
        dg = du.reshape(-1, C) @ params["fc.weight"][:, C:]
        grads["fuse.weight"] = dg.T @ feats.reshape(-1, feats.shape[-1]) if fused else xp.zeros_like(
            params["fuse.weight"])
    return ce + feature_weight * feat_loss, {"token": ce, "feature": feat_loss}, grads, f_hat


def draft_forward_backward(params: dict, config, embed, lm_subset, feats, next_tokens, next_feats, targets,
                           feature_weight: float = FEATURE_WEIGHT, ahead: int = 1):
    """EAGLE's loss on windows and its gradient for every draft parameter (``eagle.draft_param_shapes``).

    feats (B, T, C): the target's features f_t (or (B, T, (taps + 1) C), [taps; f_t], for a draft with
    params["fuse.weight"]); next_tokens (B, T): x_{t+1}; next_feats (B, T, C): f_{t+1}; targets (B, T): the
    subset index of x_{t+2}, -1 outside the subset (no token loss).
    embed (V, C) and lm_subset (V', C) are frozen. Causal attention within each window.
    ``ahead`` > 1: EAGLE-3's training-time test, steps 2..ahead on the draft's own features f^ (row i of
    step s guesses x_{i+s+1} from f^_{i+s-1} and x_{i+s}; ``AheadContext``), their losses added.
    -> (loss, {"token": CE, "feature": SmoothL1, then "token_s", "feature_s" of each later step}, grads).
    Works in the params' dtype.
    """
    if not 1 <= ahead < feats.shape[1]:
        raise ValueError(f"a training-time test of {ahead} steps needs 1 <= steps < the window ({feats.shape[1]})")
    context = AheadContext()
    loss, parts, grads, f_hat = draft_step_loss(params, config, embed, lm_subset, feats, next_tokens, next_feats,
                                                targets, context, feature_weight)
    for s in range(2, ahead + 1):
        more, terms, step_grads, f_hat = draft_step_loss(
            params, config, embed, lm_subset, f_hat[:, :-1], next_tokens[:, s - 1 :], next_feats[:, s - 1 :],
            targets[:, s - 1 :], context, feature_weight)
        loss += more
        parts |= {f"{k}_{s}": v for k, v in terms.items()}
        grads = {k: g + step_grads[k] for k, g in grads.items()}
    return loss, parts, grads


# ----------------------------------------------------------------------------------------------
# training

EAGLE_TRAIN = TrainConfig(batch_size=8, max_steps=1500, lr=1e-3, min_lr=1e-4, warmup_steps=50, weight_decay=0.0,
                          eval_every=250, ckpt_every=100, seed=0)
WINDOW = 128  # positions per training window (the draft attends within it)
HELD_OUT_SHARE = 0.05  # answers (other prompts) held out
FEATURE_NOISE = 0.1  # EAGLE's uniform noise on the input features, here relative to each feature's RMS


def pair_stream(sequences, features):
    """Each sequence's pairs j = 0..n-3 -> (f_j, x_{j+1}, f_{j+1}, x_{j+2}) as row indices and ids.

    -> (feature rows of f_j into the concatenation of ``features``, x_{j+1}, x_{j+2}); f_{j+1} is row + 1.
    """
    rows, x1, x2, base = [], [], [], 0
    for seq, feats in zip(sequences, features):
        n = len(seq)  # a sequence of 1 or 2 tokens has no pair
        rows.append(base + np.arange(max(n - 2, 0)))
        x1.append(np.asarray(seq[1 : n - 1]))
        x2.append(np.asarray(seq[2:n]))
        base += len(feats)
    return np.concatenate(rows), np.concatenate(x1).astype(np.int64), np.concatenate(x2).astype(np.int64)


class DraftData:
    """The pair stream of a data directory, split into training and held-out answers.

    Training pairs leave out those that predict a token of the chat template's header (the system
    turn every prompt starts with: the draft would only learn it by heart); held-out pairs are the
    greedy answers' own tokens, the ones speculation must guess (never fixed text's: it was not
    written by the target).
    """

    def __init__(self, data: dict, draft, n_train_tokens: int | None = None):
        n = len(data["sequences"])
        if n < 2:
            raise ValueError(f"EAGLE training needs at least 2 answers (some are held out), got {n}")
        every = max(2, round(1 / HELD_OUT_SHARE))  # every 20th answer: all temperatures and lengths
        held = list(range(every - 1, n, every)) or [n - 1]
        train = [i for i in range(n) if i not in set(held)]
        self.window = min(WINDOW, draft.config.block_size)  # positions per training window
        self.width = draft.config.n_embd  # C: a feature row may be [taps; f], (taps + 1) C wide
        self.features = np.concatenate(data["features"])  # (sum(n - 1), C) float16
        if not np.isfinite(self.features).all():
            raise ValueError("the EAGLE data's features hold nan or inf: the data is broken (write it again "
                             "with eagle-data); no learning rate can train on it")
        self.starts = np.concatenate([[0], np.cumsum([len(f) for f in data["features"]])])
        header = len(os.path.commonprefix([list(s) for s in data["sequences"]])) if n > 1 else 0
        if n_train_tokens is not None:  # whole answers drawn evenly from every folder, kind and temperature
            order = np.random.default_rng(0).permutation(train)  # one fixed draw
            pairs = np.cumsum([max(len(data["sequences"][i]) - max(header, 2), 0) for i in order])
            train = sorted(order[: int(np.searchsorted(pairs, n_train_tokens)) + 1].tolist())
        self.train = self.split(data, train, draft, [header] * len(train), n_train_tokens)
        greedy = [i for i in held if data["temperatures"][i] == 0.0 and data["kinds"][i] != "text"] or held
        self.held = self.split(data, greedy, draft, [data["prompt_lengths"][i] for i in greedy])
        if len(self.held[0]) == 0:
            raise ValueError(f"the {len(greedy)} held-out answers hold no position to score the draft on: "
                             "write more data (eagle-data --prompts N)")

    def split(self, data, indices, draft, first_targets, limit=None):
        """Pairs j of the sequences ``indices`` whose x_{j+2} sits at or after first_targets[i]."""
        rows, x1, x2 = [], [], []
        for i, first in zip(indices, first_targets):
            r, a, b = pair_stream([data["sequences"][i]], [data["features"][i]])
            keep = r + 2 >= first
            rows.append(r[keep] + self.starts[i])
            x1.append(a[keep])
            x2.append(b[keep])
        rows, x1, x2 = np.concatenate(rows), np.concatenate(x1), np.concatenate(x2)
        if limit is not None:
            rows, x1, x2 = rows[:limit], x1[:limit], x2[:limit]
        return rows, x1, draft.to_subset[x2]

    def windows(self, split, starts, length: int | None = None):
        """Windows of ``length`` (default: self.window) consecutive pairs of ``split`` from each start ->
        (f (B, T, C) or [taps; f], x_{t+1} (B, T), f_{t+1} (B, T, C), subset index of x_{t+2} (B, T))."""
        rows, x1, y = split
        T = self.window if length is None else length
        idx = np.asarray(starts)[:, None] + np.arange(T)  # (B, T)
        f = xp.asarray(self.features[rows[idx]].astype(np.float32))
        f_next = xp.asarray(self.features[rows[idx] + 1, -self.width :].astype(np.float32))
        return f, xp.asarray(x1[idx]), f_next, xp.asarray(y[idx])


def held_out_accuracy(draft, data: DraftData, max_windows: int = 64, step: int = 1) -> float:
    """Share of held-out answer positions where the draft's guess number ``step`` of a round is the target's
    token there. Step 1 reads the target's features (teacher forced, as in a round's first step); step s > 1
    reads the draft's own feature from step s - 1 and the true token before it, through an ``AheadContext``
    (the cache as drafting leaves it). Every row of the first ``max_windows`` (>= 1) windows counts, those of
    a short last window too."""
    T = data.window
    n = min(len(data.held[0]), max_windows * T)  # DraftData holds at least one
    hits = rows = 0
    for start in range(0, n, T):
        length = min(T, n - start)
        if length < step:
            continue
        f, x1, _, y = data.windows(data.held, [start], length)
        context, f_in = AheadContext(), f[0]
        for s in range(step):
            f_hat, logits = draft.step(f_in, to_numpy(x1[0, s:]), context)
            f_in = f_hat[:-1]
        hits += int((to_numpy(logits).argmax(axis=-1) == to_numpy(y[0, step - 1 :])).sum())
        rows += length - step + 1
    if rows == 0:
        raise ValueError(f"no held-out window is long enough to score guess {step}")
    return hits / rows


def train_draft(draft, data: DraftData, tc: TrainConfig = EAGLE_TRAIN, state_path=None, resume: bool = False,
                progress: bool = True, ahead: int = 1):
    """Train ``draft``'s parameters in place on ``data`` -> history (loss terms, held-out accuracy, time).

    Input features get EAGLE's uniform noise (FEATURE_NOISE x their RMS): while drafting, the draft reads
    its own guesses. AdamW with the cosine schedule of ``train.lr_at``; every tc.ckpt_every steps the parameters,
    moments, step, generator and history go atomically to ``state_path``; ``resume`` continues there.
    ``ahead`` > 1 adds EAGLE-3's training-time test (``draft_forward_backward``); the held-out score is kept
    for the first and the second guess of a round either way.
    """
    from tqdm import tqdm

    target, cfg = draft.target, draft.target.config
    embed = target.params["embed_tokens.weight"]
    lm_subset = draft.layer.params["embed_tokens.weight"]
    params = {name: xp.array(p) for name, p in draft.params.items()}  # unstacked copies: the layer keeps its stacks
    opt = AdamW(params, (tc.beta1, tc.beta2), weight_decay=tc.weight_decay)
    rng, start, history, elapsed0 = np.random.default_rng(tc.seed), 0, [], 0.0
    if resume and state_path is not None and Path(state_path).exists():
        start, history, elapsed0 = load_train_state(state_path, draft, params, opt, rng, ahead)
    n_rows = len(data.train[0])
    if n_rows <= data.window:
        raise ValueError(f"{n_rows} training positions: too few for one window of {data.window}")
    t0 = time.perf_counter()
    bar = tqdm(range(start, tc.max_steps), initial=start, total=tc.max_steps, disable=not progress,
               desc="eagle draft", mininterval=5.0)
    for step in bar:
        f, x1, f_next, y = data.windows(data.train, rng.integers(0, n_rows - data.window, size=tc.batch_size))
        f = f.reshape(*f.shape[:2], -1, data.width)  # (B, T, taps + 1, C): each feature its own RMS
        scale = xp.sqrt((f * f).mean(axis=-1, keepdims=True))  # (B, T, taps + 1, 1)
        f = f + FEATURE_NOISE * scale * xp.asarray(rng.uniform(-1.0, 1.0, f.shape).astype(np.float32))
        f = f.reshape(*f.shape[:2], -1)
        batch = (f, x1, f_next, y)  # the draft must cope with its own imprecise features while drafting
        loss, parts, grads = draft_forward_backward(params, cfg, embed, lm_subset, *batch, ahead=ahead)
        check_step(loss, clip_grad_norm(grads, tc.grad_clip), step + 1)
        opt.step(params, grads, lr_at(step, tc))
        record = {"step": step + 1, "loss": round(loss, 4), **{k: round(v, 4) for k, v in parts.items()},
                  "elapsed_s": round(elapsed0 + time.perf_counter() - t0, 1)}
        last = step + 1 == tc.max_steps
        if (step + 1) % tc.eval_every == 0 or last:
            load_params(draft, params)
            record["held_out_top1"] = round(held_out_accuracy(draft, data), 4)
            record["held_out_second_guess"] = round(held_out_accuracy(draft, data, step=2), 4)
        history.append(record)
        bar.set_postfix(loss=f"{loss:.3f}")
        if state_path is not None and ((step + 1) % tc.ckpt_every == 0 or last):
            save_train_state(state_path, draft, params, opt, step + 1, rng, history, ahead)
    bar.close()
    load_params(draft, params)
    return history


def load_params(draft, params: dict) -> None:
    """Copy trained parameters into the draft (its layer keeps q/k/v and gate/up stacked: in place)."""
    for name, p in params.items():
        draft.params[name][...] = p


TRAIN_STATE_FORMAT = "minillm-eagle-train-1"
TRAIN_STATE_KIND = "EAGLE training state"


def save_train_state(path, draft, params, opt, step, rng, history, ahead: int = 1) -> None:
    header = {"format": TRAIN_STATE_FORMAT, "model": model_identity(draft.target), "step": step, "ahead": ahead,
              "subset_size": draft.subset_size, "adam_t": opt.t, "rng_state": rng.bit_generator.state,
              "history": history, "elapsed_s": history[-1]["elapsed_s"]}
    arrays = {f"param/{k}": to_numpy(v) for k, v in params.items()} | {"subset": draft.subset}
    arrays |= {f"m/{k}": to_numpy(v) for k, v in opt.m.items()} | {f"v/{k}": to_numpy(v) for k, v in opt.v.items()}
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def train_state_layout(header: dict, draft, params: dict, path, ahead: int = 1) -> dict:
    """The arrays a training state's header implies for ``draft`` (its parameters and both AdamW moments,
    shaped like ``params``, and the subset), once its format, target and vocabulary size are checked."""
    check_format(header, TRAIN_STATE_FORMAT, path, TRAIN_STATE_KIND)
    check_trained_for(header, draft.target, path, TRAIN_STATE_KIND, "eagle-train without --resume (a new run)")
    if header.get("subset_size") != draft.subset_size:
        raise CheckpointError(f"{path} was trained with another draft vocabulary (V' {header.get('subset_size')!r}, "
                              f"not {draft.subset_size}): resume with the same --vocab")
    if header.get("ahead", 1) != ahead:
        raise CheckpointError(f"{path} was trained with --ahead {header.get('ahead', 1)!r}, not {ahead}: "
                              "resume with the same --ahead")
    return {f"{group}/{name}": (tuple(p.shape), FLOAT_WEIGHTS) for group in ("param", "m", "v")
            for name, p in params.items()} | {"subset": ((draft.subset_size,), TOKEN_IDS)}


def load_train_state(path, draft, params, opt, rng, ahead: int = 1):
    """Restore ``params``, AdamW and the generator from ``save_train_state``'s file -> (step, history, elapsed_s)."""
    header, arrays = read_npz(path, lambda header: train_state_layout(header, draft, params, path, ahead),
                              TRAIN_STATE_KIND)
    if not np.array_equal(arrays["subset"], draft.subset):
        raise CheckpointError(f"{path} was trained with another draft vocabulary: resume with the same --vocab")
    for name in params:
        params[name][...] = xp.asarray(arrays[f"param/{name}"])
        opt.m[name][...] = xp.asarray(arrays[f"m/{name}"])
        opt.v[name][...] = xp.asarray(arrays[f"v/{name}"])
    opt.t = header["adam_t"]
    rng.bit_generator.state = header["rng_state"]
    return header["step"], header["history"], header["elapsed_s"]
