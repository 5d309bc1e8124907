"""python -m minillm bench real-model: SmolLM2-135M in minillm vs Hugging Face transformers, same weights.

Both models come from the same 4-bit GGUF file: transformers dequantizes it to float32 with its own loader
(``LlamaForCausalLM.from_pretrained(folder, gguf_file=...)``); minillm keeps its Q8_0 / Q4_1 blocks (the
default) or, with ``--weights fp32``, dequantizes them to float32 as well, the same arithmetic as transformers.
Both run with the same number of BLAS / torch threads. Sections:

1. prefill tokens/s (one forward over the prompt into an empty cache) and decode tokens/s (greedy,
   one token per forward with the KV cache), minillm vs transformers, paired alternating runs;
2. KV-cached decode vs recomputing the whole context, at 256 and 1024 tokens of context;
3. KV cache bytes per token, measured from a ``KVCache``, vs the formula and vs multi-head attention;
4. the tokenizer's encoding speed in characters/s.

Discipline (see minillm.bench): validate first (logits within 1e-3 of transformers, the same greedy
tokens), warm up, then time; print aligned tables. Nothing here asserts a timing. transformers and
torch are only the yardstick: they are imported here, never by the library.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from ...backend import runtime_summary, to_numpy
from ...kv_cache import KVCache, kv_cache_bytes
from ...measure import time_pairs
from ...notebook import format_table
from ...registry import SMOLLM2, SMOLLM2_FILE, load_model, smollm2_path
from ..options import MAX_COUNT, add_weights_option, count, int_in
from .common import BenchmarkError, parse_args

LOGIT_ATOL = 1e-3  # minillm vs transformers, float32 both
CONTEXTS = (256, 1024)  # section 2
FLOAT32_BYTES = 4


def prompt_ids(n: int) -> list[int]:
    """n token ids of ordinary text-like tokens (deterministic, no tokenizer needed)."""
    return [int(t) for t in np.random.default_rng(0).integers(1000, 20000, n)]


class MinillmRunner:
    def __init__(self, model, max_len: int):
        self.model, self.cache = model, KVCache(model.config, max_len=max_len)

    def prefill(self, ids):
        self.cache.reset()
        return to_numpy(self.model.forward(np.array([ids]), self.cache)[0, -1])

    def decode(self, ids, n: int) -> list[int]:
        """Greedy: prefill ids, then n - 1 one-token steps -> n tokens."""
        logits, out = self.prefill(ids), []
        for _ in range(n):
            out.append(int(logits.argmax()))
            if len(out) < n:
                logits = to_numpy(self.model.forward(np.array([[out[-1]]]), self.cache)[0, -1])
        return out


class TransformersRunner:
    def __init__(self, torch, model):
        self.torch, self.model = torch, model

    def prefill(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids]), use_cache=True)
        self.cache = out.cache
        return out.logits[0, -1].numpy()

    def decode(self, ids, n: int) -> list[int]:
        logits, out = self.prefill(ids), []
        with self.torch.no_grad():
            for _ in range(n):
                out.append(int(logits.argmax()))
                if len(out) < n:
                    step = self.model(self.torch.tensor([[out[-1]]]), cache=self.cache, use_cache=True)
                    self.cache, logits = step.cache, step.logits[0, -1].numpy()
        return out


def prefill_decode_rows(ours, theirs, prompt, new_tokens, repeat):
    """Section 1: tokens/s of prefill and decode, each a median of paired alternating runs."""
    rows = []
    base, cand, _ = time_pairs(lambda: theirs.prefill(prompt), lambda: ours.prefill(prompt), repeat)
    rows.append(row("prefill", len(prompt), base, cand))
    prefill_s = statistics.median(base), statistics.median(cand)
    base, cand, _ = time_pairs(lambda: theirs.decode(prompt, new_tokens), lambda: ours.decode(prompt, new_tokens),
                               repeat)
    decode_base = [t - prefill_s[0] for t in base]  # decode time: generation minus its prefill
    decode_cand = [t - prefill_s[1] for t in cand]
    rows.append(row("decode", new_tokens - 1, decode_base, decode_cand))
    return rows


def row(phase, tokens, theirs_s, ours_s):
    t_theirs, t_ours = statistics.median(theirs_s), statistics.median(ours_s)
    ratios = [t / o for t, o in zip(theirs_s, ours_s)]
    return {"phase": phase, "tokens": tokens, "transformers tok/s": tokens / t_theirs, "minillm tok/s": tokens / t_ours,
            "minillm speed-up": statistics.median(ratios), "pairs": f"{min(ratios):.2f}-{max(ratios):.2f}"}


def cached_vs_recompute_row(model, L: int, repeat: int) -> dict:
    """Section 2: one new token at context L: a cached decode step vs a forward over all L + 1 tokens."""
    ids = prompt_ids(L + 1)
    cache = KVCache(model.config, max_len=L + 1)
    model.forward(np.array([ids[:L]]), cache)

    def cached():
        cache.truncate(L)
        return to_numpy(model.forward(np.array([ids[L:]]), cache)[0, -1])

    def recompute():
        return to_numpy(model.forward(np.array([ids]))[0, -1])

    err = float(np.abs(cached() - recompute()).max())
    base, cand, _ = time_pairs(recompute, cached, repeat)
    ratios = [b / c for b, c in zip(base, cand)]
    return {"context": L, "recompute ms": 1e3 * statistics.median(base), "cached ms": 1e3 * statistics.median(cand),
            "speed-up": statistics.median(ratios), "pairs": f"{min(ratios):.1f}-{max(ratios):.1f}",
            "max |logit diff|": err}


def kv_bytes_rows(config):
    """Section 3: bytes per token of a float32 KVCache, measured and by the formula."""
    n = 128
    measured = KVCache(config, max_len=n).nbytes / n
    gqa = kv_cache_bytes(config.n_layer, config.n_kv_head, config.head_size, 1, bytes_per_elem=FLOAT32_BYTES)
    mha = kv_cache_bytes(config.n_layer, config.n_head, config.head_size, 1, bytes_per_elem=FLOAT32_BYTES)
    return [{"cache": f"GQA, {config.n_kv_head} KV heads (measured)", "bytes/token": int(measured)},
            {"cache": f"formula 2*{config.n_layer}*{config.n_kv_head}*{config.head_size}*4", "bytes/token": gqa},
            {"cache": f"multi-head, {config.n_head} KV heads (formula)", "bytes/token": mha}]


def tokenizer_rows(tokenizer, repeat):
    from ...data import load_corpus

    text = load_corpus()[:200_000]
    ids = tokenizer.encode(text)  # warm-up (fills the word cache, as a running server would)
    if tokenizer.decode(ids) != text:
        raise BenchmarkError("tokenizer: decode(encode(text)) != text")
    base, cand, _ = time_pairs(lambda: tokenizer.decode(ids), lambda: tokenizer.encode(text), repeat)
    return [{"text": "Shakespeare", "chars": len(text), "tokens": len(ids),
             "encode chars/s": len(text) / statistics.median(cand),
             "decode chars/s": len(text) / statistics.median(base)}]


def load_transformers(threads):
    """(torch, LlamaForCausalLM from the same GGUF); BenchmarkError when transformers is not installed."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise BenchmarkError(f"bench real-model compares with transformers: pip install torch transformers ({exc})") \
            from None
    torch.set_num_threads(threads)
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2_path().parent, gguf_file=SMOLLM2_FILE,
                                                       dtype=torch.float32).eval()
    return torch, hf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm bench real-model", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int_in(1, 1024), default=1, help="BLAS and torch threads (default 1)")
    parser.add_argument("--prompt-tokens", type=count, default=128)
    parser.add_argument("--new-tokens", type=int_in(2, MAX_COUNT), default=33)
    parser.add_argument("--repeat", type=count, default=3)
    parser.add_argument("--quick", action="store_true", help="one pair per measurement, shorter runs")
    add_weights_option(parser)
    args = parse_args(parser, argv)
    repeat = 1 if args.quick else args.repeat
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=args.threads, user_api="blas"):
        return run(args, repeat)


def run(args, repeat) -> int:
    print(f"threads: {args.threads} (BLAS and torch)")
    model, tokenizer = load_model(SMOLLM2, weights=args.weights)
    torch, hf = load_transformers(args.threads)
    cfg = model.config
    print(f"model {SMOLLM2}: {model.num_params():,} params, {cfg.n_layer} layers, {cfg.n_head} query / "
          f"{cfg.n_kv_head} KV heads; minillm --weights {args.weights}, transformers float32\n")
    prompt = prompt_ids(args.prompt_tokens)
    ours = MinillmRunner(model, args.prompt_tokens + args.new_tokens)
    theirs = TransformersRunner(torch, hf)
    err = float(np.abs(ours.prefill(prompt) - theirs.prefill(prompt)).max())  # 1. validate
    tokens_ours, tokens_theirs = ours.decode(prompt, args.new_tokens), theirs.decode(prompt, args.new_tokens)
    if err > LOGIT_ATOL or tokens_ours != tokens_theirs:
        raise BenchmarkError(f"validation failed: max |logit diff| {err:.2e} (allowed {LOGIT_ATOL}), "
                             f"greedy tokens equal: {tokens_ours == tokens_theirs}")
    print(f"validated: max |logit diff| {err:.1e}, {args.new_tokens} greedy tokens identical\n")
    print(f"1. prefill ({args.prompt_tokens} tokens) and greedy decode ({args.new_tokens - 1} steps after it), "
          f"{repeat} alternating pairs: medians; speed-up = median of the pair ratios")
    print(format_table(prefill_decode_rows(ours, theirs, prompt, args.new_tokens, repeat)), "\n")
    contexts = CONTEXTS[:1] if args.quick else CONTEXTS
    print("2. one decode step at a given context: KV-cached vs recomputing the whole context (minillm)")
    print(format_table([cached_vs_recompute_row(model, L, repeat) for L in contexts]), "\n")
    print("3. KV cache bytes per token, float32")
    print(format_table(kv_bytes_rows(cfg)), "\n")
    print("4. tokenizer speed")
    print(format_table(tokenizer_rows(tokenizer, repeat)))
    print("\n" + runtime_summary())  # the load at the end too: it may have changed during the run
    return 0
