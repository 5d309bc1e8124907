"""A decode step at the launch floor: static shapes, fused kernels, and one CUDA graph per step.

    model.forward(ids, KVCache), array code     300-430 kernel launches per token (character model)
    StaticStep.run(), fused kernels             9 launches per layer + 6 around them
    StaticStep.step() after capture()           1 graph launch per token

A small model's decode step on a GPU costs what its launches cost the CPU, a few microseconds each, not what
its arithmetic costs the GPU. ``minillm.fused`` cuts the launches by fusing each group of elementwise and
row-wise work into one kernel; a CUDA graph then records the whole step once and relaunches it with a single
call (gpt-fast's ``torch.compile(mode="reduce-overhead")`` and nano-vllm's ``capture_cudagraph`` do this).

A graph replays exactly the kernels it recorded, with the same arguments and the same memory addresses. So a
step can be recorded only if nothing in it changes from one token to the next except the *contents* of
device memory:

- shapes are fixed: the cache is a (B, n_kv_head, max_len, hs) buffer per layer that attention reads up to
  each row's position, never sliced to a length the host knows (``StaticCache``);
- positions and lengths live on the device: the step reads ``lengths`` (B,) and adds T to it at its end;
  a Python int would be baked into the recording and replayed unchanged at every later token;
- every input, output and intermediate is allocated once, before the recording (``StaticStep``);
- nothing waits for the device (no ``int(array)``, no ``.get()``, no ``if`` on a device value) and nothing
  is copied from the host: a recording runs nothing, so there is nothing to wait for or copy into yet.

The strict stand-in (``MINILLM_BACKEND=strict``) checks all of this on a CPU: its stream capture refuses
each of those operations with an error naming the line, and its replay reruns exactly what was recorded, on
the recorded buffers. ``greedy_generate`` decodes with these steps; its reference is ``generate`` at
temperature 0 (``model.forward`` with a ``KVCache``), whose tokens it must equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import fused
from .backend import is_gpu, to_numpy, xp
from .cache_contract import CacheFullError
from .generate import check_prompt, generate
from .kv_cache import cache_capacity
from .llama import Llama
from .model import GPT
from .nn import LN_EPS

LAYER_BUDGET, OUTSIDE_BUDGET = 12, 8  # the fused step's launches per layer, and around the layers, per token
COUNTED = ("kernels", "syncs", "copies_to_device", "graph_launches")  # what the strict stand-in counts
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # the prompt the per-token counts decode after


class CaptureUnavailable(RuntimeError):
    """A CUDA graph needs a device: NumPy has no stream to record."""


class StaticCache:
    """K and V (B, n_kv_head, max_len, hs) per layer, and each row's length, all on the device.

    ``lengths`` (B,) int32 is what the steps read and advance; ``host_lengths`` is the host's copy of it,
    kept by the same calls, so the host can refuse an overflow without waiting for the device.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None):
        self.config, self.batch_size = config, batch_size
        self.max_len = cache_capacity(config, max_len)
        shape = (batch_size, config.n_kv_head, self.max_len, config.head_size)  # (B, n_kv_head, max_len, hs)
        self.k = [xp.zeros(shape, dtype=xp.float32) for _ in range(config.n_layer)]
        self.v = [xp.zeros(shape, dtype=xp.float32) for _ in range(config.n_layer)]
        self.lengths = xp.zeros(batch_size, dtype=xp.int32)
        self.host_lengths = np.zeros(batch_size, dtype=np.int64)
        self.status = xp.zeros(1, dtype=xp.int32)  # a kernel that refuses its input writes its FUSED_* code here

    def set_lengths(self, lengths) -> None:
        """Keep the first lengths[b] tokens of each row (a rollback): one copy to the device."""
        lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), (self.batch_size,))
        if lengths.min() < 0 or lengths.max() > self.max_len:
            raise ValueError(f"lengths must lie in 0..max_len={self.max_len}, got {lengths.tolist()}")
        self.host_lengths = lengths.copy()
        self.lengths[...] = xp.asarray(lengths.astype(np.int32))

    def check_status(self) -> None:
        """Read the kernels' status word (a wait) and raise KernelError if one refused its input."""
        code = int(to_numpy(self.status)[0])
        if code:
            self.status[...] = 0
            fused.raise_status(code)


@dataclass
class LayerWeights:
    """One block's weights as the step uses them: each product's matrix as (in, out), and what each fused kernel
    adds. GPT-2 stores its matrices (in, out) already; Llama's (out, in) are passed as transposed views."""

    norm_1: tuple  # (w,) RMSNorm or (w, b) LayerNorm before attention
    w_qkv: object  # (C, q_dim + 2 kv_dim)
    b_qkv: object  # (q_dim + 2 kv_dim,) or None
    w_o: object  # (C, C)
    b_o: object  # (C,) or None
    norm_2: tuple  # before the MLP
    w_up: object  # (C, 4C) GPT-2, (C, 2H) Llama (gate and up side by side)
    b_up: object  # (4C,) or None
    w_down: object  # (4C, C) or (H, C)
    b_down: object  # (C,) or None


def layer_weights(model) -> tuple[list[LayerWeights], tuple]:
    """The model's blocks as ``LayerWeights`` and its final norm's weights."""
    p, layers = model.params, []
    if isinstance(model, GPT):
        for i in range(model.config.n_layer):
            h = f"h.{i}."
            layers.append(LayerWeights(
                (p[h + "ln_1.weight"], p[h + "ln_1.bias"]), p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"],
                p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"], (p[h + "ln_2.weight"], p[h + "ln_2.bias"]),
                p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"], p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"]))
        return layers, (p["ln_f.weight"], p["ln_f.bias"])
    if isinstance(model, Llama):
        for i in range(model.config.n_layer):
            h = f"layers.{i}."
            layers.append(LayerWeights(
                (p[h + "input_layernorm.weight"],), model.stacked[h + "qkv"].T, None,
                p[h + "self_attn.o_proj.weight"].T, None, (p[h + "post_attention_layernorm.weight"],),
                model.stacked[h + "gate_up"].T, None, p[h + "mlp.down_proj.weight"].T, None))
        return layers, (p["norm.weight"],)
    raise TypeError(f"the static decode step runs a GPT or a Llama, not a {type(model).__name__}")


class StaticStep:
    """One forward of T new tokens per row at fixed addresses: T = 1 decodes, T = K + 1 verifies K drafts.

    ``ids`` (B, T) int32 in; ``logits`` (B * T, V) and ``next_ids`` (B, T) int32, their argmax, out. For T = 1
    ``next_ids`` is ``ids`` itself, so a decode step feeds itself the token it chose. ``run()`` launches the
    step's kernels; ``capture()`` records them into a CUDA graph, after which ``step()`` replays it.
    """

    def __init__(self, model, cache: StaticCache, T: int = 1):
        cfg = model.config
        if cache.config != cfg:
            raise ValueError("the cache was made for another model config")
        if cfg.head_size > fused.HS_MAX:
            raise ValueError(f"the fused attention kernel takes head sizes up to {fused.HS_MAX}, got {cfg.head_size}")
        self.model, self.cache, self.T, self.B = model, cache, int(T), cache.batch_size
        self.layers, self.final_norm = layer_weights(model)
        self.llama = isinstance(model, Llama)
        rows, C, V = self.B * self.T, cfg.n_embd, cfg.vocab_size
        q_dim, kv_dim = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size
        up_width = self.layers[0].w_up.shape[1]
        empty = lambda *shape: xp.zeros(shape, dtype=xp.float32)  # noqa: E731  (allocated once, here)
        self.ids = xp.zeros((self.B, self.T), dtype=xp.int32)
        self.next_ids = self.ids if self.T == 1 else xp.zeros((self.B, self.T), dtype=xp.int32)
        self.pos = xp.zeros(rows, dtype=xp.int32)  # (B * T,) absolute positions, written by the embedding kernel
        self.x = empty(rows, C)  # the residual stream
        self.normed = empty(rows, C)
        self.qkv = empty(rows, q_dim + 2 * kv_dim)
        self.q = empty(self.B, cfg.n_head, self.T, cfg.head_size)
        self.attn = empty(rows, q_dim)  # merged heads
        self.proj = empty(rows, C)  # the output of each sublayer, added to x by the next norm
        self.up = empty(rows, up_width)
        self.act = empty(rows, up_width // 2) if self.llama else self.up  # GPT-2's GELU works in place
        self.logits = empty(rows, V)
        self.lm_head_t = model.lm_head.T  # (C, V), a view
        self.graph = self.pool = self.stream = None
        self.eps = np.float32(cfg.norm_eps if self.llama else LN_EPS)

    # ---- the step: one launch per line -----------------------------------------------------------------

    def run(self) -> None:
        """Launch the step's kernels: 9 per layer, 6 outside them; none waits for the device."""
        cfg, c, T, i32 = self.model.config, self.cache, np.int32(self.T), np.int32
        self.embed()  # pos = lengths + t; x = wte[ids] (+ wpe[pos])
        self.norm(None, None, self.layers[0].norm_1)  # normed = norm_1(x)
        for layer, w in enumerate(self.layers):
            xp.matmul(self.normed, w.w_qkv, out=self.qkv)  # (rows, C) @ (C, q_dim + 2 kv_dim)
            dims = (T, i32(cfg.n_head), i32(cfg.n_kv_head), i32(cfg.head_size), i32(c.max_len))
            if self.llama:  # q -> self.q, k and v -> the cache at pos: RoPE on q and k
                fused.launch("qkv_rope_to_cache", (self.B * self.T,), (self.qkv, self.pos, self.q, c.k[layer],
                             c.v[layer], c.status, *dims, np.float32(cfg.rope_theta)))
            else:  # ... + the bias
                fused.launch("qkv_to_cache", (self.B * self.T,), (self.qkv, w.b_qkv, self.pos, self.q, c.k[layer],
                             c.v[layer], c.status, *dims))
            fused.launch("decode_attention", (self.T, cfg.n_head, self.B), (self.q, c.k[layer], c.v[layer], self.pos,
                         self.attn, c.status, *dims, fused.attention_scale(cfg.head_size)),
                         shared_mem=fused.attention_smem_bytes(cfg.head_size))
            xp.matmul(self.attn, w.w_o, out=self.proj)  # (rows, C) @ (C, C)
            self.norm(self.proj, w.b_o, w.norm_2)  # x += proj (+ b_o); normed = norm_2(x)
            xp.matmul(self.normed, w.w_up, out=self.up)  # (rows, C) @ (C, 4C | 2H)
            if self.llama:
                fused.launch("silu_mul", (self.B * self.T,), (self.up, self.act, i32(self.act.shape[1])))
            else:
                fused.launch("bias_gelu", (self.B * self.T,), (self.up, w.b_up, i32(self.up.shape[1])))
            xp.matmul(self.act, w.w_down, out=self.proj)  # (rows, 4C | H) @ (4C | H, C)
            last = layer + 1 == len(self.layers)
            self.norm(self.proj, w.b_down, self.final_norm if last else self.layers[layer + 1].norm_1)
        xp.matmul(self.normed, self.lm_head_t, out=self.logits)  # (rows, C) @ (C, V)
        self.next_ids[...] = self.logits.reshape(self.B, self.T, -1).argmax(axis=-1)  # two launches: argmax, copy
        c.lengths += T  # on the device: the next step reads the new length

    def embed(self) -> None:
        """pos = lengths + t and x = wte[ids] (+ wpe[pos]) for every row: one launch."""
        cfg, c, p = self.model.config, self.cache, self.model.params
        dims = (np.int32(self.T), np.int32(cfg.n_embd), np.int32(cfg.vocab_size), np.int32(c.max_len))
        if self.llama:
            args = (self.ids, c.lengths, p["embed_tokens.weight"], self.x, self.pos, c.status, *dims)
            fused.launch("embed_rows", (self.B * self.T,), args)
        else:
            args = (self.ids, c.lengths, p["wte.weight"], p["wpe.weight"], self.x, self.pos, c.status, *dims)
            fused.launch("embed_pos_rows", (self.B * self.T,), args)

    def norm(self, y, bias, weights: tuple) -> None:
        """normed = norm(x), after x += y (+ bias) when y is given: one launch."""
        C, rows = np.int32(self.model.config.n_embd), (self.B * self.T,)
        if y is None:
            name, args = ("rms_norm_rows" if self.llama else "layer_norm_rows"), (self.x, *weights)
        elif self.llama:
            name, args = "add_rms_norm_rows", (self.x, y, *weights)
        else:
            name, args = "add_layer_norm_rows", (self.x, y, bias, *weights)
        fused.launch(name, rows, (*args, self.normed, C, self.eps), shared_mem=fused.NORM_SMEM_BYTES)

    # ---- feeding it, recording it, replaying it ----------------------------------------------------------

    def set_ids(self, ids) -> None:
        """Token ids (B, T) from the host -> ``ids`` (one copy to the device), checked against the vocabulary."""
        ids = np.asarray(ids, dtype=np.int64).reshape(self.B, self.T)
        if ids.min() < 0 or ids.max() >= self.model.config.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.model.config.vocab_size - 1}")
        self.ids[...] = xp.asarray(ids.astype(np.int32))

    def step(self) -> None:
        """One step: the recorded graph when ``capture`` made one, else ``run``. Refuses to pass max_len."""
        c = self.cache
        if c.host_lengths.max() + self.T > c.max_len:
            raise CacheFullError(f"static cache full: {int(c.host_lengths.max())} cached + {self.T} new tokens > "
                                 f"max_len={c.max_len}")
        if self.graph is None:
            self.run()
        else:
            self.graph.launch()  # on the current stream: ordered after the copies that fed ids
        c.host_lengths += self.T

    def capture(self) -> None:
        """Record ``run`` into a CUDA graph, once; ``step`` replays it from then on.

        First one eager run: it compiles every kernel (a compile or module load cannot be recorded) and makes
        cuBLAS's workspace. Its effects on the state (the lengths, and ids for T = 1) are undone; the keys and
        values it wrote past the lengths are never read. The recording runs on a stream of its own (the legacy
        default stream cannot record) with a memory pool of its own, so no array made after it can be given
        the memory the graph's temporaries use at every replay.
        """
        if not is_gpu():
            raise CaptureUnavailable("a CUDA graph needs a device (CuPy, or MINILLM_BACKEND=strict)")
        if self.graph is not None:
            return
        lengths, ids = self.cache.lengths.copy(), self.ids.copy()
        self.run()
        self.cache.lengths[...] = lengths
        self.ids[...] = ids
        self.stream, self.pool = xp.cuda.Stream(non_blocking=True), xp.cuda.MemoryPool()
        with self.stream, xp.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            try:
                self.run()
            finally:
                graph = self.stream.end_capture()
        self.graph = graph


def prefill(model, tokens: list, max_len: int) -> StaticCache:
    """A static cache of ``max_len`` slots holding ``tokens`` (one eager step of T = len(tokens); none for [])."""
    cache = StaticCache(model.config, 1, max_len)
    if tokens:
        step = StaticStep(model, cache, T=len(tokens))
        step.set_ids([tokens])
        step.step()
    return cache


def start_decoding(model, prompt: list, max_len: int, graph: bool = False) -> StaticStep:
    """The T = 1 decode step of a static cache that holds prompt[:-1], its ids holding prompt[-1]: each
    ``step()`` feeds the last token and leaves the next one, its argmax, in ``ids``. With ``graph`` the step is
    captured, so each ``step()`` is one graph launch."""
    decode = StaticStep(model, prefill(model, prompt[:-1], max_len), T=1)
    decode.set_ids([[prompt[-1]]])
    if graph:
        decode.capture()
    return decode


def next_id(step: StaticStep) -> int:
    """The token a T = 1 step chose, brought to the host: the one wait per token."""
    return int(to_numpy(step.ids)[0, 0])


def greedy_generate(model, prompt_ids, max_new_tokens: int, graph: bool = False) -> list:
    """Greedy decoding on static steps: the prompt but its last token in one eager step, then one T = 1 step per
    token, replayed from a CUDA graph with ``graph=True``. The host waits once per token, for its id.

    The same tokens as ``generate(model, prompt_ids, max_new_tokens, temperature=0).tokens`` (the reference);
    prompt and new tokens must fit in the model's block_size (the static cache does not slide a window).
    """
    prompt = check_prompt(prompt_ids, max_new_tokens)
    if max_new_tokens == 0:
        return []
    decode = start_decoding(model, prompt, len(prompt) + max_new_tokens - 1, graph)
    tokens = []
    while len(tokens) < max_new_tokens:
        decode.step()
        tokens.append(next_id(decode))
    decode.cache.check_status()
    return tokens


def greedy_speculative_generate(target, draft, prompt_ids, max_new_tokens: int, k: int = 4,
                                graph: bool = False) -> list:
    """Greedy speculative decoding on static steps: per round the draft's T = 1 step proposes k tokens and the
    target's T = k + 1 step verifies them in one forward; with ``graph`` both steps are replayed from their
    graphs (one per model, per fixed k). Same tokens as ``generate(target, ..., temperature=0)``.

    Both caches hold every token but the last one emitted (``last``). A round feeds the target [last, d_1..d_k];
    its argmaxes g_0..g_k accept the drafts while d_i == g_(i-1); the first mismatch, or g_k after k matches, is
    the new ``last``. Rollback is one copy of each cache's lengths to the device (``StaticCache.set_lengths``).
    """
    prompt = check_prompt(prompt_ids, max_new_tokens)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (drafts per round) must be an int >= 1, got {k!r}")
    max_len = len(prompt) + max_new_tokens + k  # the last round may verify k + 1 tokens past the emitted ones
    propose = start_decoding(draft, prompt, max_len, graph)
    verify = StaticStep(target, prefill(target, prompt[:-1], max_len), T=k + 1)
    if graph:
        verify.capture()
    tokens, last = [], prompt[-1]
    while len(tokens) < max_new_tokens:
        length = int(verify.cache.host_lengths[0])  # tokens both caches hold: everything before `last`
        propose.set_ids([[last]])
        drafts = []
        for _ in range(k):
            propose.step()
            drafts.append(next_id(propose))
        verify.set_ids([[last, *drafts]])
        verify.step()
        greedy = to_numpy(verify.next_ids)[0].tolist()  # (k + 1,) the target's argmax after each fed token
        accepted = next((i for i, d in enumerate(drafts) if d != greedy[i]), k)
        tokens += drafts[:accepted] + [greedy[accepted]]
        verify.cache.set_lengths(length + 1 + accepted)  # last and the accepted drafts
        if accepted == k:  # the draft has not seen d_k yet: feed it
            propose.set_ids([[drafts[-1]]])
            propose.step()
        else:
            propose.cache.set_lengths(length + 1 + accepted)
        last = greedy[accepted]
    verify.cache.check_status()
    return tokens[:max_new_tokens]


# ---- what a decoded token costs the device, counted by the strict stand-in (MINILLM_BACKEND=strict) -------


def per_token(model, steps: int) -> dict:
    """{kernels, syncs, copies_to_device, graph_launches} per decoded token of ``generate`` (the array code, greedy):
    the counts of 1 + steps new tokens minus those of 1, over steps (the prefill cancels out)."""
    generate(model, PROMPT, 1, temperature=0)  # warm-up: what is made once (the kernel's status word)
    runs = []
    for n in (1, 1 + steps):
        xp.reset_counts()
        generate(model, PROMPT, n, temperature=0)
        runs.append(dict(xp.COUNTS))
    return {k: (runs[1].get(k, 0) - runs[0].get(k, 0)) / steps for k in COUNTED}


def static_per_token(model, steps: int, graph: bool) -> dict:
    """The same counts per decoded token of the static T = 1 step after a prefill, eager or replayed from its
    captured graph."""
    decode = start_decoding(model, PROMPT, len(PROMPT) + steps, graph)
    decode.step()  # the prompt's last token
    xp.reset_counts()
    for _ in range(steps):
        decode.step()
        next_id(decode)
    return {k: xp.COUNTS.get(k, 0) / steps for k in COUNTED}


def launch_budget(config) -> int:
    """The fused step's launch budget per decoded token: 12 per layer plus 8 around the layers."""
    return LAYER_BUDGET * config.n_layer + OUTSIDE_BUDGET
