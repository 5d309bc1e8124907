"""The main demo (``python -m minillm``) says what it measured: a speculative part that does not pay says
so, and why, in one line computed from the run's own numbers."""

import re

import pytest

from minillm.checkpoint import shipped_path
from minillm.speculative import SpecStats
from minillm.tools import demo


def stats_of(k: int, rounds: int, new_tokens: int, accepted: int, rejected: int, verified=None) -> SpecStats:
    return SpecStats(k=k, rounds=rounds, target_calls=rounds, new_tokens=new_tokens, accepted=accepted,
                     rejected=rejected, verified=k * rounds if verified is None else verified)


@pytest.mark.host_only
def test_verdict_of_a_run_that_does_not_pay_gives_its_cost_and_yield():
    """0.65x with 1.3 tokens per round: the round cost 1.3 / 0.65 = 2 decode steps; the draft's share of
    the time splits it (0.25 of 2 drafting, the rest verifying); alpha = accepted / checked = 3 / 10."""
    line = demo.speculation_verdict("EAGLE chain K=4", 0.65, stats_of(4, 10, 13, 3, 7), 11, draft_share=0.25)
    assert line == ("EAGLE chain K=4 does not pay here (0.65x): a round costs 2.00 decode steps (drafting 4.0 tokens "
                    "0.50, verifying 5.0 and the rest 1.50) and yields 1.30 tokens, the target keeping 30% of the "
                    "draft's guesses; see chapter 11")
    assert "\n" not in line
    sized = stats_of(3, 10, 13, 3, 7, verified=15)  # a chain of at most 3 that drafted 1.5 tokens a round
    assert "(drafting 1.5 tokens 0.50, verifying 2.5 and" in demo.speculation_verdict("K<=3", 0.65, sized, 11, 0.25)


@pytest.mark.host_only
def test_verdict_of_a_run_that_pays_says_so():
    line = demo.speculation_verdict("speculative K=4", 1.5, stats_of(4, 10, 30, 20, 0), 5)
    assert line.startswith("speculative K=4 pays here (1.50x): a round costs 2.00 decode steps and yields 3.00")
    assert "drafting" not in line and "100%" in line and line.endswith("see chapter 5")


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "5.2", "5.3")  # generate and speculative decoding
@pytest.mark.skipif(not shipped_path("target").is_file(), reason="shipped models not trained yet")
def test_demo_verdict_agrees_with_its_table(capsys):
    """The verdict line quotes the speed-up of the table above it, and its cost times that speed-up is
    the table's tokens per call: one set of numbers, not two."""
    assert demo.main(["--max-new-tokens", "24", "--k", "3", "--no-real-model", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("speculative K=3"))
    tokens_per_call, speedup = float(row[-3]), float(row[-1])
    verdict = re.search(r"speculative K=3 (pays|does not pay) here \(([\d.]+)x\): a round costs ([\d.]+) decode "
                        r"steps and yields ([\d.]+) tokens", out)
    assert verdict, out
    assert (verdict[1] == "pays") == (speedup >= 1)
    assert float(verdict[2]) == pytest.approx(speedup, abs=0.006)
    assert float(verdict[4]) == pytest.approx(tokens_per_call, abs=0.006)
    assert float(verdict[3]) * float(verdict[2]) == pytest.approx(tokens_per_call, rel=0.02)
