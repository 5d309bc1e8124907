"""The command line: it works, and bad input gets a usage error or one clear line, no traceback."""

import subprocess
import sys

import pytest

from minillm import CharTokenizer, save_model
from minillm.checkpoint import shipped_path

# Tests that also run other exercises' code, so they fail until those are solved (minillm.course)
NEEDS = {("3.1", "3.3"): "generate_streams or generate_uses"}


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


def test_generate_streams_text_and_stats(tiny_checkpoint):
    r = run_cli("generate", "--model", tiny_checkpoint, "--prompt", "abc", "--max-new-tokens", "12",
                "--temperature", "0")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("abc") and len(r.stdout.strip()) == 15
    assert "TTFT" in r.stderr and "tokens/s" in r.stderr
    naive = run_cli("generate", "--model", tiny_checkpoint, "--prompt", "abc", "--max-new-tokens", "12",
                    "--temperature", "0", "--no-cache")  # fmt: skip
    assert naive.stdout == r.stdout  # the KV cache changes the speed, not the text


@pytest.mark.skipif(not shipped_path("target").is_file(), reason="shipped target not trained yet")
def test_generate_uses_the_shipped_target_by_default():
    r = run_cli("generate", "--prompt", "ROMEO:", "--max-new-tokens", "30", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout) >= 36


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["generate", "--max-new-tokens", "many"], 2, "invalid int value"),
        (["generate", "--bogus"], 2, "unrecognized arguments"),
        (["bench", "nope"], 2, "invalid choice"),
        (["train"], 2, "--preset"),
        (["generate", "--model", "/nonexistent/model.npz"], 1, "checkpoint not found"),
    ],
)
def test_bad_arguments_give_usage_errors_not_tracebacks(args, code, message):
    r = run_cli(*args)
    assert r.returncode == code
    assert message in r.stderr and "Traceback" not in r.stderr


def test_unknown_prompt_character_is_named(tiny_checkpoint):
    r = run_cli("generate", "--model", tiny_checkpoint, "--prompt", "abz")
    assert r.returncode == 1
    assert "characters not in the vocabulary: 'z'" in r.stderr and "Traceback" not in r.stderr
