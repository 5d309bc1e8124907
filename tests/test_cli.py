"""The command line: it works, and bad input gets a usage error or one clear line, no traceback."""

import subprocess
import sys

import pytest

from minillm import CharTokenizer, save_model
from minillm.checkpoint import shipped_path
from minillm.tools import cli
from minillm.tools.benchmarks import common
from minillm.tools.benchmarks import paged as paged_bench


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_model):
    path = tmp_path / "tiny.npz"
    save_model(path, tiny_model, CharTokenizer("abcdefghijklm"))
    return str(path)


def test_info():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert "backend:" in r.stdout and "GPU:" in r.stdout and "model target" in r.stdout


@pytest.mark.uses_exercise("3.1", "3.3")
def test_generate_streams_text_and_stats(tiny_checkpoint):
    r = run_cli("generate", "--model", tiny_checkpoint, "--prompt", "abc", "--max-new-tokens", "12",
                "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("abc") and len(r.stdout.strip()) == 15
    assert "TTFT" in r.stderr and "tokens/s" in r.stderr
    naive = run_cli("generate", "--model", tiny_checkpoint, "--prompt", "abc", "--max-new-tokens", "12",
                    "--temperature", "0", "--no-cache")
    assert naive.stdout == r.stdout  # the KV cache changes the speed, not the text


@pytest.mark.uses_exercise("3.1", "3.3")
@pytest.mark.skipif(not shipped_path("target").is_file(), reason="shipped target not trained yet")
def test_generate_uses_the_shipped_target_by_default():
    r = run_cli("generate", "--prompt", "ROMEO:", "--max-new-tokens", "30", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout) >= 36


@pytest.mark.host_only  # refused options: the commands' device runs are the other tests here
@pytest.mark.parametrize(
    "args,code,message",
    [
        (["generate", "--max-new-tokens", "many"], 2, "invalid int value"),
        (["generate", "--bogus"], 2, "unrecognized arguments"),
        (["bench", "nope"], 2, "invalid choice"),
        (["train"], 2, "--preset"),
        (["generate", "--model", "/nonexistent/model.npz"], 1, "checkpoint not found"),
        (["generate", "--model", "tests"], 1, "tests is a directory, not a checkpoint file"),
        (["generate", "--seed", "-1"], 2, "argument --seed: must be >= 0, got -1"),
        (["generate", "--temperature", "nan"], 2, "argument --temperature: must be a finite number"),
        (["generate", "--top-p", "2"], 1, "top_p must be in (0, 1]"),
        (["--k", "0"], 2, "argument --k: must be >= 1"),
        (["demo", "--max-new-tokens", "0"], 2, "argument --max-new-tokens: must be >= 1"),
        (["train", "--preset", "draft", "--steps", "-5"], 2, "argument --steps: must be >= 1"),
        (["bench", "paged", "--out", "x", "--update-docs"], 2, "not allowed with argument --out"),
        (["bench", "speculative", "--ks", "0,2"], 2, "argument --ks: must be >= 1, got 0"),
        (["bench", "paged", "--no-ttft", "--requests", "0"], 2, "argument --requests: must be >= 1, got 0"),
        (["course", "student-edition", "/nonexistent/edition", "--chapters", "11"], 1, "no exercises in chapter(s) 11"),
    ],
)
def test_bad_arguments_give_usage_errors_not_tracebacks(args, code, message):
    """One line on stderr naming the problem (after argparse's usage line for a usage error), nothing on
    stdout: the arguments are checked before the prompt or anything else is printed."""
    r = run_cli(*args)
    assert r.returncode == code
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()[-1]) > 0 and message in r.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not shipped_path("draft").is_file(), reason="shipped draft not trained yet")
def test_train_never_overwrites_a_shipped_model_unless_asked(capsys):
    before = shipped_path("draft").read_bytes()
    code = cli.main(["train", "--preset", "draft", "--steps", "2", "--out", str(shipped_path("draft"))])
    assert code == 1
    assert "--overwrite-shipped" in capsys.readouterr().err
    assert shipped_path("draft").read_bytes() == before


DEMO_ARGS = [["--max-new-tokens", "12", "--k", "3", "--answer-tokens", "12"],
             ["demo", "--k", "3", "--max-new-tokens", "9", "--no-real-model"]]


@pytest.mark.skipif(not shipped_path("target").is_file(), reason="shipped models not trained yet")
@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "5.2", "5.3")  # the demo runs generate and speculative decoding
@pytest.mark.parametrize("args", [pytest.param(DEMO_ARGS[0], id="with_real_model",  # and opens with SmolLM2
                                               marks=pytest.mark.uses_exercise("8.1", "8.2", "8.3", "8.4")),
                                  pytest.param(DEMO_ARGS[1], id="demo_only")])
def test_demo_options_with_and_without_the_demo_command(args, capsys):
    """`python -m minillm --k 3` and `python -m minillm demo --k 3` both run the demo with K = 3; the
    demo opens with the real model's streamed answer unless told not to."""
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "K=3" in out and "speculative K=3" in out and "identical: yes" in out
    real = "--no-real-model" not in args and registry_model_installed()
    assert ("assistant: The capital of France is Paris" in out and "TTFT" in out) == real


def registry_model_installed() -> bool:
    from minillm.registry import SMOLLM2, GGUFError, gguf_path

    try:
        return gguf_path(SMOLLM2).is_file()
    except GGUFError:
        return False


def test_benchmark_validation_failure_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    def broken(*args, **kwargs):
        raise common.BenchmarkError("block size 4: 3 blocks for 9 tokens")

    monkeypatch.setattr(paged_bench, "validate_paged_formula", broken)
    assert cli.main(["bench", "paged", "--no-ttft", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.err == "error: block size 4: 3 blocks for 9 tokens\n"
    assert all(line.startswith(("backend ", "WARNING: the load")) for line in captured.out.splitlines()), captured.out


@pytest.mark.skipif(not shipped_path("target").is_file(), reason="shipped models not trained yet")
def test_benchmarks_write_figures_to_the_named_or_default_folder_only(monkeypatch, tmp_path, capsys):
    """Figures go to --out DIR, else to the default folder outside the project; never to the working
    directory's docs/figures."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "DEFAULT_FIG_DIR", tmp_path / "default")
    assert cli.main(["bench", "training-curves"]) == 0
    assert cli.main(["bench", "training-curves", "--out", "mine"]) == 0
    made = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert made == ["default", "default/training_curves.png", "mine", "mine/training_curves.png"]


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1", "10.1", "10.2", "10.3")
@pytest.mark.skipif(not shipped_path("target").is_file(), reason="shipped target not trained yet")
def test_serve_demo_takes_its_options_through_the_cli(capsys):
    """`python -m minillm serve-demo --requests 3`: a continuous-batching replay, then one row per request."""
    assert cli.main(["serve-demo", "--requests", "3", "--rate", "50", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit() and "'" in line]
    assert len(rows) == 3 and "TTFT ms" in out


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2", "9.3", "9.4")
def test_generate_speculate_prints_the_models_own_text(capsys):
    """Every draft-free method of chapter 9, greedy, prints exactly what plain decoding prints."""
    outs = {}
    for mode in (None, "lookup", "layer-skip", "medusa", "lookahead"):
        argv = ["generate", "--temperature", "0", "--max-new-tokens", "40", *(["--speculate", mode] if mode else [])]
        assert cli.main(argv) == 0
        captured = capsys.readouterr()
        outs[mode] = captured.out
        assert (mode or "KV cache") in captured.err
    assert all(out == outs[None] for out in outs.values()), outs


def test_generate_medusa_without_shipped_heads_is_one_line(capsys):
    assert cli.main(["generate", "--model", "draft", "--speculate", "medusa", "--max-new-tokens", "3"]) == 1
    assert "no Medusa heads ship for model 'draft'" in capsys.readouterr().err
