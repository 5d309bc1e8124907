"""bench verify-cost: the roofline arithmetic and the table rows (what it computes, never a timing)."""

import numpy as np
import pytest

from minillm.config import GPTConfig
from minillm.measure import STAND_INS
from minillm.model import GPT
from minillm.tools.benchmarks.verify_cost import (
    block_weights,
    bound,
    by_path,
    cost_rows,
    describe_choices,
    forward_bytes,
    forward_flops,
    matmul_rows,
    matmul_weights,
    parts_rows,
    roofline_seconds,
)


def test_roofline_is_the_slower_of_moving_the_bytes_and_doing_the_arithmetic():
    assert roofline_seconds(1e9, 1e9, bandwidth=1e10, peak=1e11) == pytest.approx(0.1)  # memory: 0.1 s > 0.01 s
    assert roofline_seconds(1e9, 1e12, bandwidth=1e10, peak=1e11) == pytest.approx(10.0)  # compute
    assert bound(1e9, 1e9, 1e10, 1e11) == "memory" and bound(1e9, 1e12, 1e10, 1e11) == "compute"


def test_flops_count_two_per_weight_per_token_plus_attention_over_the_keys():
    """The docstring's worked example; attention grows with the keys, the weights' part with n only."""
    cfg = GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=1, n_embd=4)
    assert forward_flops(1000, cfg, n=2, context=3) == 4000 + 160  # 2*2*1000 + 2*2*2*(3+2)*4
    assert forward_flops(1000, cfg, n=1, context=0) == 2000 + 16
    assert forward_bytes(100, cfg, n=2, context=3) == 100 + 2 * 1 * 1 * 4 * 5 * 4  # K and V, float32


def test_matmul_weights_are_the_matrices_read_in_full_with_the_tied_head_once():
    """GPT: every 2-D block weight plus wte once (as the LM head); wpe is looked up by row, not read."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    model = GPT.init(cfg)
    weights = matmul_weights(model)
    C = cfg.n_embd
    assert sum(a.size for a in weights) == cfg.n_layer * 12 * C * C + cfg.vocab_size * C
    assert sum(a is model.params["wte.weight"] for a in weights) == 1


def test_cost_rows_pair_each_round_with_the_same_paths_single_token_step():
    """A path's v(n) is the median of per-round ratios t(n) / t(1) of that same path, not a ratio of
    medians, nor over the other path's step; the floor adds only the roofline's growth to t_best(1),
    the faster path's step of the same round."""
    times = {"blas": {1: [1.0, 2.0, 4.0], 4: [1.5, 2.0, 8.0]},
             "stream": {1: [2.0, 1.0, 4.0], 4: [1.0, 3.0, 4.0]}}  # t_best(1) per round: 1, 1, 4
    roofline = {1: 0.5, 4: 1.0}
    rows = cost_rows(times, roofline, {1: "memory", 4: "compute"})
    assert [r["n"] for r in rows] == [1, 4]
    one, four = rows
    assert one["blas v"] == 1.0 and one["stream v"] == 1.0  # per round 1, 2, 1 and 2, 1, 1: medians 1
    assert one["floor (steps)"] == 1.0
    assert four["blas v"] == 1.5  # ratios 1.5, 1.0, 2.0; over t_best(1) (1, 1, 4) they would be 1.5, 2.0, 2.0
    assert four["stream v"] == 1.0  # ratios 0.5, 3.0, 1.0; a ratio of medians would say 3.0 / 2.0 = 1.5
    assert four["stream/blas"] == pytest.approx(2 / 3) and four["pairs"] == "0.50-1.50"  # 1/1.5, 3/2, 4/8
    assert four["floor (steps)"] == pytest.approx(1 + 0.5 / 1.0)  # median t_best(1) 1 s, roofline +0.5 s
    assert four["roof (steps)"] == pytest.approx(1.0)
    assert four["blas ms"] == pytest.approx(2000.0) and four["stream ms"] == pytest.approx(3000.0)


def test_cost_rows_of_one_path_leave_out_the_comparison():
    rows = cost_rows({"blas": {1: [2.0], 2: [3.0]}}, {1: 1.0, 2: 1.0}, {1: "memory", 2: "memory"})
    assert rows[1]["blas v"] == 1.5 and "stream/blas" not in rows[1]


def test_by_path_splits_the_alternating_keys():
    assert by_path({("blas", 1): [1], ("stream", 1): [2], ("blas", 4): [3]}) == {
        "blas": {1: [1], 4: [3]}, "stream": {1: [2]}}


def test_describe_choices_counts_the_shapes_that_chose_the_stream_per_bucket():
    """The docstring's example, and the line printed when nothing was measured."""
    assert describe_choices({(8, 4, "rows", 1): "stream", (4, 8, "rows", 1): "blas"}) == "rows 1: 1/2 stream"
    assert describe_choices({}).startswith("none")


def test_parts_rows_pivot_the_ablation_and_leave_the_rest_to_everything_else():
    def ablation(whole, each):
        return [{"part": "whole step", "part us": whole}] + [{"part": p, "part us": each} for p in STAND_INS]

    rows = parts_rows({8: ablation(900.0, 200.0), 1: ablation(500.0, 100.0)})
    by_part = {r["part"]: r for r in rows}
    assert list(by_part) == ["whole forward", *STAND_INS, "everything else"]
    assert by_part["whole forward"]["growth 1->8 us"] == 400
    assert by_part["everything else"]["n=1 us"] == 500 - 100 * len(STAND_INS)
    assert np.isclose(by_part["everything else"]["n=8 us"], 900 - 200 * len(STAND_INS))


def test_matmul_rows_compare_each_n_with_the_best_single_row_product_and_the_roofline():
    """1000 weights (4000 bytes) at 1e9 B/s take 4 us to read; 2 n 1000 FLOPs at 1e9 FLOP/s take 2n us.
    "x n=1" divides by the faster path's best n = 1 product (stream here: 3 us)."""
    times = {"blas": {1: [6e-6, 4e-6], 4: [16e-6, 90e-6]}, "stream": {1: [3e-6, 5e-6], 4: [9e-6, 12e-6]}}
    rows = matmul_rows(times, 1000, bandwidth=1e9, peak=1e9)
    assert [r["n"] for r in rows] == [1, 4]
    assert rows[0]["roofline us"] == pytest.approx(4.0) and rows[1]["roofline us"] == pytest.approx(8.0)
    assert rows[1]["blas us"] == pytest.approx(16.0) and rows[1]["stream us"] == pytest.approx(9.0)
    assert rows[1]["blas x n=1"] == pytest.approx(16 / 3) and rows[0]["stream x n=1"] == pytest.approx(1.0)
    assert rows[1]["stream GFLOP/s"] == pytest.approx(8000 / 9e-6 / 1e9)


def test_block_weights_are_what_the_forward_multiplies():
    """GPT-2: the four [in, out] weights of block 0 as (out, in) views; Llama: stacked q/k/v and gate/up."""
    from minillm.config import LlamaConfig
    from minillm.llama import Llama

    gpt = GPT.init(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    assert [w.shape for w in block_weights(gpt)] == [(24, 8), (8, 8), (32, 8), (8, 32)]
    llama = Llama.init(LlamaConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_kv_head=1, n_embd=8,
                                   n_hidden=12))
    assert [w.shape for w in block_weights(llama)] == [(16, 8), (8, 8), (24, 8), (8, 12)]


def test_a_context_that_leaves_no_room_for_the_new_tokens_is_a_usage_error(capsys):
    """100 cached + 64 new fits the 256-token context; 250 + 8 does not: exit 2 naming the limit, nothing timed."""
    from minillm.tools.benchmarks.verify_cost import main

    with pytest.raises(SystemExit) as exc:
        main(["--context", "250", "--ns", "1,8", "--no-parts"])
    assert exc.value.code == 2
    assert "--context 250 + n up to 8 exceeds block_size=256" in capsys.readouterr().err


def test_load_and_json_are_parsed_before_anything_is_timed(capsys):
    """--load takes a count of busy processes (a negative one is a usage error, exit 2)."""
    from minillm.tools.benchmarks.verify_cost import main

    with pytest.raises(SystemExit) as exc:
        main(["--load", "-1", "--no-parts"])
    assert exc.value.code == 2 and "--load" in capsys.readouterr().err
