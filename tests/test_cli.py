"""The command line: it works, and bad input gets a usage error or one clear line, no traceback."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minillm import CharTokenizer, save_model
from minillm.checkpoint import shipped_path
from minillm.eagle import shipped_draft_path
from minillm.speculative_chat import EAGLE_DEPTH
from minillm.tools import cli
from minillm.tools.benchmarks import common
from minillm.tools.benchmarks import paged as paged_bench
from minillm.tools.options import MAX_NEW_TOKENS


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


def check_dropped_prompt_note(checkpoint, capsys, modes) -> None:
    """A 40-token prompt in a 32-token context: one note on stderr saying how many tokens were dropped;
    a 20-token prompt: none."""
    prompt = "abcdefghijklm" * 3 + "a"  # 40 tokens
    for extra in modes:
        assert cli.main(["generate", "--model", checkpoint, "--prompt", prompt, "--max-new-tokens", "4",
                         "--temperature", "0", *extra]) == 0
        err = capsys.readouterr().err
        notes = [line for line in err.splitlines() if line.startswith("note:")]
        dropped = 8 if extra == ["--no-cache"] else 24  # no cache: the context's 32 tokens; else half of it
        assert notes == [f"note: the prompt's first {dropped} of 40 tokens were dropped: they do not fit the "
                         f"context; the model saw its last {40 - dropped}"], err
        assert cli.main(["generate", "--model", checkpoint, "--prompt", prompt[:20], "--max-new-tokens", "4",
                         *extra]) == 0
        assert "note:" not in capsys.readouterr().err


@pytest.mark.uses_exercise("3.1", "3.3")
def test_generate_streams_and_says_how_many_prompt_tokens_were_dropped(tiny_checkpoint, capsys):
    """A prompt longer than the model's 32-token context keeps its last 16 tokens (its last 32 without
    a cache): the command says so in one line on stderr; it used to print the whole prompt and say
    nothing. A prompt that fits gets no note."""
    check_dropped_prompt_note(tiny_checkpoint, capsys, ([], ["--no-cache"]))


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2", "9.3", "9.4")
def test_generate_speculate_says_how_many_prompt_tokens_were_dropped(tiny_checkpoint, capsys):
    """The same note with --speculate lookup (the tree loop of chapter 9 crops the prompt the same way)."""
    check_dropped_prompt_note(tiny_checkpoint, capsys, (["--speculate", "lookup"],))


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
        (["course", "student-edition", "/nonexistent/edition", "--chapters", "14"], 1, "no exercises in chapter(s) 14"),
        (["serve", "--port", "70000"], 2, "argument --port: must be <= 65535"),
        (["serve", "--max-num-seqs", "1000000000"], 2, "argument --max-num-seqs: must be <= 1024, got 1000000000"),
        (["serve", "--num-blocks", "1000000000000"], 2, "argument --num-blocks: must be <= 65536"),
        (["serve", "--page-size", "1000000000"], 1, "is over the limit of 65,536 blocks and 16 GB"),  # before any pool
        (["serve", "--model", "gpt-4"], 2, "argument --model: invalid choice"),
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


DEMO_ARGS = [["--max-new-tokens", "12", "--k", "3", "--answer-tokens", "12", "--repeats", "1"],
             ["demo", "--k", "3", "--max-new-tokens", "9", "--no-real-model", "--temperature", "0"]]


@pytest.mark.skipif(not shipped_path("target").is_file(), reason="shipped models not trained yet")
@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "5.2", "5.3")  # the demo runs generate and speculative decoding
@pytest.mark.parametrize("args", [pytest.param(DEMO_ARGS[0], id="with_real_model",  # and opens with SmolLM2
                                               marks=[pytest.mark.uses_exercise("8.1", "8.2", "8.3", "8.4"),
                                                      pytest.mark.slow]),
                                  pytest.param(DEMO_ARGS[1], id="demo_only")])
def test_demo_options_with_and_without_the_demo_command(args, capsys):
    """`python -m minillm --k 3` and `python -m minillm demo --k 3` both run the demo with K = 3; the
    demo opens with the real model's streamed answer unless told not to."""
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "K=3" in out and "speculative K=3" in out
    greedy = "--temperature" in args  # part 2 samples at 0.8 by default
    assert ("greedy outputs identical: yes" in out) == greedy
    assert ("(temperature > 0: two samples" in out) == (not greedy)
    real = "--no-real-model" not in args and registry_model_installed()
    assert ("assistant: The capital of France is Paris" in out and "TTFT" in out) == real
    eagle = real and shipped_draft_path("smollm2-135m").is_file()
    assert (f"EAGLE chain K={EAGLE_DEPTH}" in out and "identical: yes" in out) == eagle


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


class ParserBuilt(Exception):
    """Raised instead of parsing: carries the parser a command built."""


def every_parser(monkeypatch) -> list:
    """The parsers of every command: the CLI's (with its subcommands), each benchmark's, the GPU check's,
    the chat's, the demo's and the serve-demo's, each caught when its command starts to parse."""
    import argparse
    import importlib

    from minillm.tools import chat_cli, demo, gpu_check
    from minillm.tools.benchmarks import TOPICS
    from minillm.tools.benchmarks import serving as serving_bench

    def caught(self, args=None, namespace=None):
        raise ParserBuilt(self)

    parsers = [cli.build_parser()]
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    mains = [importlib.import_module(m).main for m in TOPICS.values()]
    for main in [*mains, gpu_check.main, chat_cli.main, demo.main, serving_bench.demo]:
        with pytest.raises(ParserBuilt) as built:
            main([])
        parsers.append(built.value.args[0])
    found, todo = [], list(parsers)
    while todo:
        parser = todo.pop()
        found.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return found


@pytest.mark.host_only
def test_every_numeric_option_is_checked_when_parsed(monkeypatch):
    """No option of any command takes a raw int or float (`--rate nan` spun forever, `--timeout nan`
    passed, `--temperature nan` reached the model, `--num-blocks 1e11` built a 7.6 GB free list): each
    numeric option has a checked type from minillm.tools.options, which refuses nan."""
    import argparse

    parsers = every_parser(monkeypatch)
    assert len(parsers) > 20
    raw = []
    for parser in parsers:
        for action in parser._actions:
            name = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
            numeric = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            if action.type in (int, float) or (numeric and action.type is None and action.nargs != 0):
                raw.append(name)
            elif numeric:
                with pytest.raises(argparse.ArgumentTypeError):
                    action.type("nan")
    assert raw == [], f"numeric options without a checked type: {raw}"


@pytest.mark.host_only
@pytest.mark.parametrize("args,message", [
    (["serve-demo", "--rate", "nan"], "argument --rate: must be a finite number"),
    (["serve-demo", "--num-blocks", "100000000000"], "argument --num-blocks: must be <= 65536"),
    (["chat", "--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["chat", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["bench", "serving", "--rate", "nan"], "argument --rate: must be a finite number"),
    (["bench", "threads", "--timeout", "nan"], "argument --timeout: must be a finite number"),
    (["bench", "speculative", "--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    (["bench", "lookahead", "--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    (["bench", "speculative", "--temperatures", "0,nan"], "argument --temperatures: must be a finite number"),
    *[([command, option, "99999999999"], f"argument {option}: must be <= {MAX_NEW_TOKENS}, got 99999999999")
      for command, option in [("generate", "--max-new-tokens"), ("chat", "--max-new-tokens"),
                              ("demo", "--max-new-tokens"), ("demo", "--answer-tokens")]],
    *[([command, "--seed", str(10**23)], f"argument --seed: must be <= {2**63 - 1}, got {10**23}")
      for command in ("generate", "chat", "demo")],
    (["serve-demo", "--num-blocks", str(10**12)], "argument --num-blocks: must be <= 65536"),
])
def test_numeric_options_out_of_range_are_usage_errors(args, message, capsys, monkeypatch):
    """Values that spun forever, grew memory without end or divided by zero: a usage error (exit 2)
    before anything runs. `generate --max-new-tokens 99999999999` ran until stopped; `generate --seed 10**23`
    was taken though numpy's generators take at most 2**63 - 1 here."""
    def ran(args):
        raise AssertionError(f"{args.command} ran with a value it should have refused")

    for command in ("cmd_generate", "cmd_chat", "cmd_demo", "cmd_serve_demo"):  # (bench parses in its command)
        monkeypatch.setattr(cli, command, ran)  # a value let through fails the test at once, never runs
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err.strip().splitlines()[-1] and captured.out == ""


def test_train_refuses_an_existing_out_file_before_any_work(tmp_path, capsys):
    """`train --out notes.txt` replaced the text file with a model: one line naming --overwrite, exit 1,
    the file untouched."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    assert cli.main(["train", "--preset", "draft", "--steps", "2", "--out", str(notes), "--quiet"]) == 1
    assert "notes.txt already exists: pass --overwrite" in capsys.readouterr().err
    assert notes.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.fixture
def generating(tiny_checkpoint):
    """`python -m minillm generate` streaming a long text to a pipe -> the process, once it has printed;
    killed at the end of the test whatever happened.

    The longest text generate writes, one character a token, is more than a pipe holds (64 KiB): the
    process is still writing (or waiting for the pipe to drain) when the test acts, however long a busy
    machine keeps the test from running; 3,000 tokens fit in the pipe and were all written by then."""
    import os

    def as_from_a_terminal():  # a job started with `&` by a script inherits SIGINT ignored; a terminal's does not
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-m", "minillm", "generate", "--model", tiny_checkpoint, "--prompt",
                             "abc", "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-cache"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | {"PYTHONUNBUFFERED": "1"},
                            preexec_fn=as_from_a_terminal)
    try:
        assert proc.stdout.read(5)  # the prompt and the first tokens: generation is under way
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.host_only
def test_ctrl_c_during_generate_is_one_line_and_exit_130(generating):
    """Ctrl-C during generate printed a KeyboardInterrupt traceback: one line, exit 130 (what the shell
    reports for SIGINT); the text printed so far stays."""
    generating.send_signal(signal.SIGINT)
    out, err = generating.communicate(timeout=60)
    assert generating.returncode == 130, err
    assert "Traceback" not in err.decode() and err.decode().strip().splitlines()[-1] == "interrupted"


@pytest.mark.host_only
def test_ctrl_c_that_a_finalizer_swallows_is_raised_again(monkeypatch):
    """Ctrl-C landing in a __del__ (llvmlite's, when the garbage collector frees numba's LLVM objects during a
    generation) was printed as "Exception ignored" and generation went on: within interrupts_kept it is raised
    again in the main thread, with nothing printed; other unraisable exceptions are reported as before."""
    from minillm.tools.cli import interrupts_kept

    class Finalized:
        def __init__(self, exc):
            self.exc = exc

        def __del__(self):
            raise self.exc

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_type))
    # Python's own Ctrl-C handler, as in a terminal: a test run started with `&` by a script inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt), interrupts_kept():
            Finalized(KeyboardInterrupt())  # freed at once: its __del__ raises where no caller can see it
            time.sleep(5)  # the main thread goes on, here blocked in the kernel, and is woken by the signal
        assert time.perf_counter() - start < 4 and reported == []
    finally:
        signal.signal(signal.SIGINT, previous)
    with interrupts_kept():
        Finalized(ValueError("lost"))
    assert reported == [ValueError]


@pytest.mark.host_only
def test_output_into_a_closed_pipe_ends_quietly(generating):
    """`generate | head` ended with "error: [Errno 32] Broken pipe" (exit 1): it stops quietly, with
    the status a shell gives `yes | head` (141), and nothing on stderr."""
    generating.stdout.close()  # the reader goes, as head does after its lines
    err = generating.stderr.read().decode()
    generating.wait(timeout=60)
    assert generating.returncode == 141 and err == ""


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2", "9.3", "9.4")
def test_generate_speculate_medusa_loads_heads_from_the_file_the_hint_names(tmp_path, capsys):
    """The hint for a model without shipped heads named `--out HEADS.npz`, which generate could not load:
    `--medusa-heads HEADS.npz` loads them, and greedy output is the model's own."""
    from minillm.medusa import MedusaHeads
    from minillm.registry import load_model

    model, _ = load_model("draft")
    MedusaHeads.init(model, 4).save(tmp_path / "heads.npz")
    argv = ["generate", "--model", "draft", "--temperature", "0", "--max-new-tokens", "12"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main([*argv, "--speculate", "medusa", "--medusa-heads", str(tmp_path / "heads.npz")]) == 0
    assert capsys.readouterr().out == plain
    assert cli.main([*argv, "--speculate", "medusa"]) == 1
    assert "then pass --medusa-heads HEADS.npz" in capsys.readouterr().err


def test_generate_on_a_nan_checkpoint_is_one_line(tmp_path, tiny_model, capsys):
    """A diverged run's model printed newlines and exited 0 (NaN probabilities sample as token 0):
    generate refuses it when loading, in one line, exit 1, before printing the prompt."""
    tiny_model.params["wte.weight"][...] = np.nan
    save_model(tmp_path / "nan.npz", tiny_model, CharTokenizer("abcdefghijklm"))
    assert cli.main(["generate", "--model", str(tmp_path / "nan.npz"), "--prompt", "abc"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "wte.weight holds non-finite values" in captured.err


def test_info_says_no_gpu_under_the_strict_stand_in():
    """`info` said "GPU: yes" under MINILLM_BACKEND=strict, where NumPy computes."""
    import os

    r = subprocess.run([sys.executable, "-m", "minillm", "info"], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"MINILLM_BACKEND": "strict"})
    assert r.returncode == 0, r.stderr
    assert "GPU: no (the strict stand-in" in r.stdout


def test_info_lists_a_damaged_smollm2_file_as_unavailable(tmp_path, monkeypatch, capsys):
    """A corrupt SmolLM2 file was listed as available (info only checked that it existed)."""
    from minillm import registry

    damaged = tmp_path / "model.gguf"
    damaged.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setattr(registry, "smollm2_path", lambda: damaged)
    assert cli.main(["info"]) == 0
    line = [s for s in capsys.readouterr().out.splitlines() if s.startswith("model smollm2")][0]
    assert "unavailable" in line and "model.gguf has 104 bytes" in line


@pytest.mark.parametrize("argv,message", [
    (["bench", "paged", "--model", "/nope.npz", "--no-plots"], "checkpoint not found: /nope.npz"),
    (["demo", "--question", " "], "--question is empty"),
    (["bench", "speculative", "--prompt-len", "100000", "--no-plot"], "longer than the model's context (256 tokens)"),
    (["generate", "--activations", "int8", "--max-new-tokens", "3"], "--activations int8 is for a GGUF model"),
    (["chat", "--model", "target", "--activations", "int8", "--prompt", "hi"], "--activations int8 is for a GGUF"),
])
def test_bad_inputs_are_one_line_before_any_work(argv, message, capsys):
    """`bench paged --model /nope.npz` ran on random weights (exit 0); `demo --question ""` failed after
    its header; `bench speculative --prompt-len 100000` said "max_new_tokens must be >= 0, got -99744":
    each is one line naming the problem, exit 1, with nothing but the benchmark's runtime line before."""
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err
    assert all(line.startswith(("backend ", "WARNING: the load")) for line in captured.out.splitlines()), captured.out


def test_eagle_commands_bad_input_is_one_line(tmp_path, capsys):
    assert cli.main(["generate", "--model", "draft", "--speculate", "eagle", "--max-new-tokens", "3"]) == 1
    assert "no EAGLE draft ships for model 'draft'" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["eagle-train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "d.npz")]) == 1
    assert "holds no EAGLE data parts" in capsys.readouterr().err
    assert cli.main(["eagle-data", "--out", str(tmp_path / "data"), "--prompts", "0"]) == 1
    assert "--prompts and --max-new-tokens must be >= 1" in capsys.readouterr().err
    for source, texts in (["rewrites"], []), (["advice"], ["--texts", str(tmp_path)]):
        assert cli.main(["eagle-data", "--out", str(tmp_path / "data"), "--source", *source, *texts]) == 1
        assert "--texts DIR goes with --source rewrites, and --source rewrites needs it" in capsys.readouterr().err


@pytest.mark.host_only
def test_a_kv_pool_too_large_is_refused_before_it_is_built():
    """`serve --max-num-seqs 1000000000` (a pool of every request's context) was killed at 23.7 GB and
    `--num-blocks 10**12` built a free list for minutes: the options are bounded when parsed, and the pool
    they size together (blocks times bytes per block, which depend on the model) is checked before it is
    built; a pool within the limits passes and its size is the docstring's."""
    import argparse

    from minillm.config import GPTConfig, LlamaConfig
    from minillm.tools import options

    target = GPTConfig(vocab_size=84, block_size=256, n_layer=6, n_head=4, n_embd=256)  # the shipped target's
    assert options.check_kv_pool(target, 48, 16) == 9_437_184  # K and V of 6 layers of 4 heads of 64, float32
    smollm2 = LlamaConfig()
    blocks = -(-smollm2.block_size * 10**9 // 16)  # the context for each of 1e9 requests, as serve sizes it
    for num_blocks, page_size in [(blocks, 16), (10**12, 16), (options.MAX_KV_BLOCKS, 16), (1, 10**9)]:
        with pytest.raises(ValueError, match="KV pool .* is over the limit"):
            options.check_kv_pool(smollm2, num_blocks, page_size)
    for parse, text in [(options.num_seqs, "1000000000"), (options.kv_blocks, str(10**12))]:
        with pytest.raises(argparse.ArgumentTypeError, match="must be <="):
            parse(text)


@pytest.mark.host_only
@pytest.mark.parametrize("extra", [[], ["--model", "target"]])
def test_serve_load_against_no_server_is_one_line_and_exit_2(extra, capsys):
    """`bench serve-load --url` naming a port nobody listens on printed an 89-line traceback (with --model,
    every request failed and the run reported a table): one line naming --url, exit 2, before any load."""
    import socket

    from minillm.tools.benchmarks import serve_load

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound but not listening: a connection is refused
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        assert serve_load.main(["--url", url, "--rate", "1", "--duration", "1", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: argument --url: cannot reach {url}/v1/models: ConnectError")
    assert captured.err.count("\n") == 1
    assert all(line.startswith(("backend ", "WARNING: the load")) for line in captured.out.splitlines()), captured.out


WEIGHTS_COMMANDS = ["generate", "chat", "serve", "demo", "medusa-train", "eagle-data", "eagle-train",
                    "bench real-model", "bench real-speculation"]  # every command that loads a GGUF model by name


@pytest.mark.host_only
def test_every_command_that_loads_a_model_by_name_takes_weights(monkeypatch):
    """--weights q|fp32 on each of them, one option (tools.options.add_weights_option), default q: SmolLM2 in its
    file's blocks, the float32 reference one option away."""
    parsers = {p.prog.removeprefix("python -m minillm").strip(): p for p in every_parser(monkeypatch)}
    for command in WEIGHTS_COMMANDS:
        (weights,) = [a for a in parsers[command]._actions if "--weights" in a.option_strings]
        assert (tuple(weights.choices), weights.default) == (("q", "fp32"), "q"), command


@pytest.mark.host_only
@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["demo"], [], ["medusa-train", "--out", "x"],
                                     ["bench", "real-model"], ["bench", "real-speculation"]],
                         ids=lambda command: " ".join(command) or "(the demo, no command)")
def test_a_bad_weights_value_is_a_usage_error(command, capsys, monkeypatch):
    """`--weights int4`: argparse's usage error naming the option and the choices (exit 2), before anything runs."""
    monkeypatch.setattr(common, "parse_args", lambda parser, argv: parser.parse_args(argv))  # no runtime line
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--weights", "int4"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert "argument --weights: invalid choice: 'int4'" in last and "fp32" in last and captured.out == ""


class Loaded(Exception):
    """Raised by a stand-in loader, once it has seen what it was asked for."""


@pytest.mark.host_only
@pytest.mark.parametrize("weights", [[], ["--weights", "fp32"]])
def test_weights_reach_the_loader(weights, monkeypatch):
    """generate, chat, serve and the demo load SmolLM2 as --weights says (q when not given)."""
    from minillm import registry
    from minillm.tools import chat_cli, demo, server

    asked = []

    def loader(name, attention=None, weights=None):
        asked.append((name, weights))
        raise Loaded

    monkeypatch.setattr(registry, "load_model", loader)  # generate imports it when it runs
    monkeypatch.setattr(demo, "load_any_model", loader)
    for run in (lambda: cli.main(["generate", "--model", "smollm2-135m", *weights]),
                lambda: chat_cli.run(chat_args(chat_cli, weights), loader=loader),
                lambda: server.make_server(serve_args(server, weights), loader=loader),
                lambda: demo.real_model_answer(demo_args(demo, weights))):
        with pytest.raises(Loaded):
            run()
    want = "fp32" if weights else "q"
    assert asked == [("smollm2-135m", want), ("smollm2-135m", want), ("smollm2-135m", want), ("smollm2-135m", want)]


def parsed(module, argv):
    import argparse

    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def chat_args(chat_cli, weights):
    return parsed(chat_cli, ["--model", "smollm2-135m", *weights])


def serve_args(server, weights):
    return parsed(server, ["--model", "smollm2-135m", *weights])


def demo_args(demo, weights):
    return parsed(demo, weights)
