"""`lodger chat` at a real terminal (a pseudo-terminal driven by pexpect), as a person uses it.

Arrow keys edit the line (the edited question gets the edited question's answer), Up recalls an
earlier line, Ctrl-C during a reply stops that reply and the session goes on, keys typed during a
reply appear neither in the reply nor in the next prompt, /reset and /adapter STEP work, and an
empty line ends the session with exit code 0.
"""

from __future__ import annotations

import os
import re
import shutil
import signal

import pexpect
import psutil
import pytest

from helpers import LODGER, STANDARD_JOB, lodger_env, wait_until

LEFT, UP = "\x1b[D", "\x1b[A"
PROMPT = "you>"  # prompt_toolkit draws the space after it as a cursor move
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[=>]")
MAX_TOKENS = 48  # a reply of many pieces: the one Ctrl-C stops has more to come
# The chat freezes itself (SIGSTOP) right after printing the 2nd piece of its first reply, so the
# test's keys and Ctrl-C land mid-reply for sure, however loaded the machine (a race before: the
# reply could end first). It freezes once per process: later replies run through.
FREEZE = "chat_token@2:stop"
FROZEN_PIECES = 2


@pytest.fixture
def chat_home(baseline, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(baseline.home, home)
    return home


@pytest.fixture
def engine(chat_home, tiny_model_dir, monkeypatch):
    """The same engine the chat loads, in this process, for the expected answers."""
    from lodger.model import model_folder, resolve_source
    from lodger.serve.engine import Engine

    monkeypatch.setenv("LODGER_HOME", str(chat_home))
    return Engine(model_folder(resolve_source(str(tiny_model_dir))))


def answer(engine, run_id: str, history: list[dict], slot: str | None = None) -> str:
    pieces = engine.generate(slot or run_id, engine.encode_chat(history), max_tokens=MAX_TOKENS, temperature=0,
                             top_p=1.0, seed=None, stop=[])
    return "".join(piece for piece, _, _ in pieces)


def spawn(home, run_id: str) -> pexpect.spawn:
    env = lodger_env(home, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", LODGER_FAULT=FREEZE)
    return pexpect.spawn(LODGER, ["chat", run_id, "--max-tokens", str(MAX_TOKENS)], env=env, encoding="utf-8",
                         codec_errors="replace", dimensions=(50, 400), timeout=240, preexec_fn=_as_at_a_terminal)


def _as_at_a_terminal() -> None:
    """Ctrl-C's SIGINT as a person's shell leaves it: a suite started in the background (`make test &`,
    nohup) ignores SIGINT, and an ignored signal is inherited and never even pending."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pending_signals(pid: int) -> set[int]:
    """Signals waiting for process ``pid`` (its own and its thread group's, /proc/PID/status)."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    mask = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


def reply_after(child: pexpect.spawn) -> str:
    """The reply printed after `model> `, up to the next prompt (terminal escapes removed)."""
    child.expect_exact("model> ")
    child.expect_exact(PROMPT)
    return ANSI.sub("", child.before).replace("\r\n", "\n").removesuffix("\n")


def test_chat_at_a_terminal_edits_lines_stops_replies_and_goes_on(baseline, chat_home, engine):
    run_id = baseline.run_id
    engine.add_run(run_id, "lora")
    question = {"role": "user", "content": "What is 2 + 3?"}
    child = spawn(chat_home, run_id)
    try:
        child.expect_exact(f"chatting with {run_id}@step-{STANDARD_JOB['steps']:08d}")
        child.expect_exact(PROMPT)

        # keys typed during a reply, then Ctrl-C: the reply stops, the session goes on
        child.send("Tell me more.\r")
        chat = psutil.Process(child.pid)
        wait_until(lambda: chat.status() == psutil.STATUS_STOPPED, 240,
                   what="the chat to freeze itself mid-reply (LODGER_FAULT)", interval=0.02)
        child.send("zzz")
        child.sendintr()  # the terminal's SIGINT waits, pending, until the chat goes on
        # The terminal turns ^C into SIGINT a moment after the write (the kernel's pty worker): go on
        # only once the signal is pending, or the reply could end before it arrives (seen under load).
        wait_until(lambda: signal.SIGINT in pending_signals(child.pid), 60, what="Ctrl-C's SIGINT to be pending",
                   interval=0.02)
        os.kill(child.pid, signal.SIGCONT)
        child.expect_exact("model> ")
        child.expect_exact(" [stopped]")
        partial = ANSI.sub("", child.before).replace("\r\n", "\n")
        child.expect_exact(PROMPT)
        assert "zzz" not in partial, "typed keys were echoed into the reply"
        full = answer(engine, run_id, [{"role": "user", "content": "Tell me more."}])
        assert full.startswith(partial) and len(partial) < len(full), (len(partial), len(full))
        pieces = engine.generate(run_id, engine.encode_chat([{"role": "user", "content": "Tell me more."}]),
                                 max_tokens=MAX_TOKENS, temperature=0, top_p=1.0, seed=None, stop=[])
        assert partial == "".join(piece for piece, _, _ in list(pieces)[:FROZEN_PIECES]), \
            "Ctrl-C stopped the reply right where it was frozen"
        child.send("/reset\r")
        child.expect_exact("(conversation forgotten)")
        child.expect_exact(PROMPT)

        # "Wht is 2 + 3?" with the cursor moved back 11 places and "a" inserted: "What is 2 + 3?"
        child.send("Wht is 2 + 3?" + LEFT * 11 + "a\r")
        reply = reply_after(child)
        assert reply == answer(engine, run_id, [question]), "the edited line is what was sent"
        assert "zzz" not in reply and "\x1b" not in reply and "[D" not in reply
        child.send("/reset\r")
        child.expect_exact(PROMPT)

        # Up recalls earlier lines; the keys typed during the stopped reply were dropped
        child.send(UP + UP + "\r")  # the line before the last /reset: "What is 2 + 3?"
        child.expect_exact("model> ")
        line = ANSI.sub("", child.before)
        assert "What is 2 + 3?" in line and "zzz" not in line and "Tell me more" not in line, repr(line)
        child.expect_exact(PROMPT)
        child.send("/reset\r")
        child.expect_exact(PROMPT)

        older = STANDARD_JOB["steps"] - STANDARD_JOB["every_steps"]  # the previous checkpoint kept
        child.send(f"/adapter {older}\r")
        child.expect_exact(f"(now answering: {run_id}@step-{older:08d})")
        child.send("What is 2 + 3?\r")
        assert reply_after(child) == answer(engine, run_id, [question],
                                            slot=engine.add_checkpoint(run_id, older).name)
        child.send("/adapter 3\r")
        child.expect_exact("no committed checkpoint at step 3")
        child.send("/adapter latest\r")
        child.expect_exact(f"(now answering: {run_id}@step-{STANDARD_JOB['steps']:08d})")

        child.send("\r")  # an empty line ends the session
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)
    assert "Aborted" not in (child.before or "")
