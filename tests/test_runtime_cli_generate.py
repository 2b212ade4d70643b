"""`kiln generate` / `kiln chat`.

Option handling runs in-process on the tiny text model (fast); the two end-to-end runs use
the default model (SmolLM2-135M-Instruct GGUF) in a subprocess, as a user would: one checks
that `kiln generate` streams (text arrives in pieces, long before the process ends), the
other drives `kiln chat` through a pipe and expects the right answer to a question.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.runtime import cli
from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import SamplingParams

from runtime_text_model import text_model_dir

KILN = [sys.executable, "-m", "kiln.runtime.cli"]
# Keep the default model's KV cache small: the tests need a few hundred tokens.
SMALL_ENGINE = ["--max-model-len", "512", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(text_model_dir(tmp_path_factory))


@pytest.fixture(scope="module")
def reference_llm(model_dir) -> LLM:
    """What the CLI's output is compared with: the same model through the Python API."""
    return LLM(model_dir, progress=False)


def subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_explains_every_option(command, capsys):
    parser = subparser(command)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 10, f"{command} {action.option_strings or action.dest} has no help"
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop"):
        assert option in text
    if command == "generate":
        assert "--chat" in text and "PROMPT" in text


def test_generate_streams_prompts_in_order_as_one_batch(model_dir, reference_llm, capsys):
    args = ["generate", "First prompt", "Second one", "--model", model_dir, "--max-tokens", "8",
            "--temperature", "0", "--ignore-eos", "--stats"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    expected = [o.outputs[0].text for o in reference_llm.generate(["First prompt", "Second one"],
                                                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    assert captured.out == (f"--- [1/2] First prompt\nFirst prompt{expected[0]}\n"
                            f"--- [2/2] Second one\nSecond one{expected[1]}\n")
    assert captured.err.count("[8 tokens, finish: length") == 2
    assert "Loading weights" in captured.err  # the loading progress bar


def test_generate_chat_mode_uses_the_template(model_dir, reference_llm, capsys):
    assert cli.main(["generate", "hi", "--chat", "--system", "Be brief.", "--model", model_dir,
                     "--max-tokens", "5", "--seed", "3", "--temperature", "0.7"]) == 0
    out = capsys.readouterr().out
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    (want,) = reference_llm.chat(messages, SamplingParams(max_tokens=5, seed=3, temperature=0.7))
    assert out == want.outputs[0].text + "\n"


def test_bad_options_fail_with_a_message_naming_them(model_dir, capsys):
    assert cli.main(["generate", "x", "--model", model_dir, "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert cli.main(["generate", "ok", "", "--model", model_dir]) == 2
    assert "prompt 2: prompt is empty" in capsys.readouterr().err


def test_chat_reads_a_pipe_and_keeps_the_conversation(model_dir, reference_llm, monkeypatch, capsys):
    import io

    too_long = "word " * 700  # over max_model_len (512): reported, and the chat goes on without it
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"hello\n\n{too_long}\nand then?\n/reset\nhello\n/exit\nignored\n"))
    assert cli.main(["chat", "--model", model_dir, "--max-tokens", "4", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 3
    assert "kiln chat: error: max_tokens" in captured.err and "max_model_len" in captured.err
    llm = reference_llm
    params = SamplingParams(max_tokens=4, temperature=0)
    first = llm.chat([{"role": "user", "content": "hello"}], params)[0].outputs[0].text
    second = llm.chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "and then?"}], params)[0].outputs[0].text
    assert lines == [first, second, first]  # /reset forgot the conversation


# ---- the default model, as a user runs it ---------------------------------------------

def run_and_time_output(cmd: list[str], stdin: str | None = None,
                        timeout: float = 300) -> tuple[int, list[tuple[float, bytes]], str, float]:
    """Run `cmd`; return its exit code, stdout pieces with arrival times, stderr, end time."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    pieces: list[tuple[float, bytes]] = []
    err_chunks: list[bytes] = []

    def read_out() -> None:
        while chunk := os.read(proc.stdout.fileno(), 65536):
            pieces.append((time.monotonic(), chunk))

    def read_err() -> None:
        err_chunks.append(proc.stderr.read())

    threads = [threading.Thread(target=read_out), threading.Thread(target=read_err)]
    for t in threads:
        t.start()
    if stdin is not None:
        proc.stdin.write(stdin.encode())
    proc.stdin.close()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    end = time.monotonic()
    for t in threads:
        t.join()
    return rc, pieces, b"".join(err_chunks).decode(errors="replace"), end


@pytest.mark.slow
def test_kiln_generate_streams_the_default_model():
    prompt = "The three primary colors are"
    rc, pieces, err, end = run_and_time_output(
        KILN + ["generate", prompt, "--max-tokens", "12", "--ignore-eos", *SMALL_ENGINE])
    assert rc == 0, err
    out = b"".join(p for _, p in pieces).decode()
    assert out.startswith(prompt) and len(out) > len(prompt) + 12
    # Streamed: the continuation came in several writes, spread over the generation.
    text_pieces = [(t, p) for t, p in pieces if p.strip()]
    assert len(text_pieces) >= 4, f"output came in {len(text_pieces)} piece(s): {pieces}"
    assert text_pieces[-1][0] - text_pieces[0][0] > 0.05
    assert "%|" in err, "no progress bar while the weights loaded"


@pytest.mark.slow
def test_kiln_chat_answers_through_a_pipe():
    rc, pieces, err, _ = run_and_time_output(
        KILN + ["chat", "--max-tokens", "24", *SMALL_ENGINE], stdin="What is the capital of France?\n")
    assert rc == 0, err
    answer = b"".join(p for _, p in pieces).decode()
    assert "Paris" in answer, answer
    assert answer.endswith("\n") and "> " not in answer  # a pipe gets no prompt marker
