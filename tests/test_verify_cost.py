"""bench verify-cost: the roofline arithmetic and the table rows (what it computes, never a timing)."""

import numpy as np
import pytest

from minillm.config import GPTConfig
from minillm.measure import STAND_INS
from minillm.model import GPT
from minillm.tools.benchmarks.verify_cost import (
    bound,
    cost_rows,
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


def test_cost_rows_pair_each_round_with_its_own_single_token_step():
    """v(n) is the median of per-round ratios, not a ratio of medians; the floor adds only the roofline's
    growth to the measured step."""
    times = {1: [1.0, 2.0, 4.0], 4: [1.5, 2.0, 8.0]}  # per-round ratios 1.5, 1.0, 2.0
    roofline = {1: 0.5, 4: 1.0}
    rows = cost_rows(times, roofline, {1: "memory", 4: "compute"})
    assert [r["n"] for r in rows] == [1, 4]
    assert rows[0]["v (steps)"] == 1.0 and rows[0]["floor (steps)"] == 1.0
    assert rows[1]["v (steps)"] == 1.5  # a ratio of medians would say 2.0 / 2.0 = 1
    assert rows[1]["pairs"] == "1.00-2.00"
    assert rows[1]["floor (steps)"] == pytest.approx(1 + 0.5 / 2.0)  # median step 2 s, roofline +0.5 s
    assert rows[1]["ms"] == pytest.approx(2000.0) and rows[1]["ms/token"] == pytest.approx(500.0)
    assert rows[1]["measured/roofline"] == pytest.approx(2.0)


def test_parts_rows_pivot_the_ablation_and_leave_the_rest_to_everything_else():
    def ablation(whole, each):
        return [{"part": "whole step", "part us": whole}] + [{"part": p, "part us": each} for p in STAND_INS]

    rows = parts_rows({8: ablation(900.0, 200.0), 1: ablation(500.0, 100.0)})
    by_part = {r["part"]: r for r in rows}
    assert list(by_part) == ["whole forward", *STAND_INS, "everything else"]
    assert by_part["whole forward"]["growth 1->8 us"] == 400
    assert by_part["everything else"]["n=1 us"] == 500 - 100 * len(STAND_INS)
    assert np.isclose(by_part["everything else"]["n=8 us"], 900 - 200 * len(STAND_INS))


def test_matmul_rows_compare_each_n_with_the_matrix_vector_product_and_the_roofline():
    """1000 weights (4000 bytes) at 1e9 B/s take 4 us to read; 2 n 1000 FLOPs at 1e9 FLOP/s take 2n us."""
    rows = matmul_rows({1: [6e-6, 4e-6], 4: [16e-6, 90e-6]}, 1000, bandwidth=1e9, peak=1e9)  # best rounds: 4, 16
    assert [r["n"] for r in rows] == [1, 4]
    assert rows[0]["roofline us"] == pytest.approx(4.0) and rows[1]["roofline us"] == pytest.approx(8.0)
    assert rows[1]["x n=1"] == pytest.approx(16 / 4) and rows[1]["measured/roofline"] == pytest.approx(2.0)
    assert rows[1]["GFLOP/s"] == pytest.approx(8000 / 16e-6 / 1e9)


def test_a_context_that_leaves_no_room_for_the_new_tokens_is_a_usage_error(capsys):
    """100 cached + 64 new fits the 256-token context; 250 + 8 does not: exit 2 naming the limit, nothing timed."""
    from minillm.tools.benchmarks.verify_cost import main

    with pytest.raises(SystemExit) as exc:
        main(["--context", "250", "--ns", "1,8", "--no-parts"])
    assert exc.value.code == 2
    assert "--context 250 + n up to 8 exceeds block_size=256" in capsys.readouterr().err
