"""`specdecode chat`: a session's turns equal `LLM.chat` over the whole conversation, /reset
forgets it, a conversation past the context is an error the session survives; and the real
command driven through a pseudo-terminal (pexpect): two turns, a Ctrl-C that stops a long
answer but not the session, /reset, /exit."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_model

from specdecode.commands.chat import PROMPT, ChatSession
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

TURN_TIMEOUT_S = 120
LONG_CONTEXT = 4096  # the pty test's model: room for an answer long enough to interrupt
LONG_ANSWER = 2000  # tokens: seconds of the tiny model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("chat_llama"), "llama")


def _session(model_dir: Path, max_tokens: int = 12) -> ChatSession:
    llm = LLM(model=str(model_dir), dtype="float32")
    return ChatSession(llm, SamplingParams(temperature=0.0, max_tokens=max_tokens), "be brief")


def _reader(lines: list[str]):
    """`input` for a session: the lines, then end of input (Ctrl-D)."""
    pending = iter(lines)

    def read(_: str) -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    return read


def test_turns_equal_chat_over_the_whole_conversation(model_dir: Path) -> None:
    session = _session(model_dir)
    lines = _reader(["hello", "/help", "/nope", "and again", "/reset", "hi", "/exit", "never"])
    written: list[str] = []
    reports: list[str] = []
    session.run(lines, written.append, reports.append)
    llm = session.llm
    params = SamplingParams(temperature=0.0, max_tokens=12)
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    (one,) = llm.chat(first, params)
    second = [*first, {"role": "assistant", "content": one.text}]
    second.append({"role": "user", "content": "and again"})
    (two,) = llm.chat(second, params)
    (fresh,) = llm.chat([first[0], {"role": "user", "content": "hi"}], params)
    assert "".join(written) == one.text + "\n" + two.text + "\n" + fresh.text + "\n"
    assert session.messages[-1] == {"role": "assistant", "content": fresh.text}
    assert len(session.messages) == 3  # the reset left the system message and one exchange
    assert any("unknown command /nope" in r for r in reports)
    assert sum("tokens/s" in r for r in reports) == 3
    assert "[conversation reset]" in reports


def test_a_conversation_past_the_context_is_reported(model_dir: Path) -> None:
    session = _session(model_dir)
    lines = _reader(["x" * 400, "hi"])  # 400 byte tokens: past the tiny model's 256
    reports: list[str] = []
    written: list[str] = []
    session.run(lines, written.append, reports.append)
    assert written[-1] == "\n"  # end of input ends the line
    assert "context is 256" in reports[0] and "/reset" in reports[0]
    assert "tokens/s" in reports[1]  # the next turn runs


def _interruptible() -> None:
    """In the child before exec: Ctrl-C raises KeyboardInterrupt whatever the test process
    inherited or set. A SIGINT ignored there is ignored in the child too (seen in the full
    suite: some earlier test's library left SIGINT at SIG_IGN, and the answer ran to its end)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_the_command_in_a_terminal(tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect", reason="pexpect is not installed")
    model = build_tiny_model(tmp_path / "long", "llama", context=LONG_CONTEXT)
    ngram = '{"method": "ngram", "num_speculative_tokens": 4}'
    args = ["-m", "specdecode.cli", "chat", str(model), "--dtype", "float32"]
    args += ["--speculative-config", ngram, "--max-tokens", str(LONG_ANSWER)]
    child = pexpect.spawn(
        sys.executable,
        args,
        encoding="utf-8",
        timeout=TURN_TIMEOUT_S,
        preexec_fn=_interruptible,
    )
    try:
        child.expect_exact(PROMPT)
        for _ in range(2):
            child.sendline("/reset")  # keeps each turn's prompt short
            child.expect_exact("[conversation reset]")
            child.expect_exact(PROMPT)
        child.sendline("tell me a long story")
        child.expect_exact("tell me a long story")  # the terminal's echo
        child.expect(r"\S")  # the answer has started
        child.sendintr()  # Ctrl-C: stops the answer
        child.expect(r"\[stopped \(Ctrl-C\), (\d+) tokens in .*acceptance")
        assert 0 < int(child.match.group(1)) < LONG_ANSWER
        child.expect_exact(PROMPT)
        child.sendline("/reset")
        child.expect_exact("[conversation reset]")
        child.sendline("hello")  # the session goes on after the Ctrl-C
        child.expect(r"\[\d+ tokens in .* tokens/s")
        child.expect_exact(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
