"""Pieces of `lodger serve` in isolation: the token file, the token and Host checks, the penalties,
the message parts."""

from __future__ import annotations

import stat

import pytest
from pydantic import ValidationError

from lodger.errors import LodgerError
from lodger.serve.auth import allowed_hosts, ensure_token, read_token, token_matches, token_path
from lodger.serve.schema import ChatRequest, Message


def test_the_token_is_created_owner_only_once_and_then_reused(lodger_home):
    token, created = ensure_token()
    assert created and len(token) >= 32
    assert token_path() == lodger_home / "serve-token"
    assert stat.S_IMODE(token_path().stat().st_mode) == 0o600
    assert ensure_token() == (token, False)
    assert read_token() == token
    assert [p.name for p in lodger_home.iterdir() if p.name.startswith(".serve-token")] == [], "no temp file left"


def test_a_token_file_others_can_read_is_tightened(lodger_home):
    token, _ = ensure_token()
    token_path().chmod(0o644)
    assert ensure_token() == (token, False)
    assert stat.S_IMODE(token_path().stat().st_mode) == 0o600


def test_an_empty_token_file_is_an_error_naming_it(lodger_home):
    token_path().write_text("\n")
    with pytest.raises(LodgerError, match="serve-token is empty"):
        ensure_token()


def test_no_token_file_reads_as_none(lodger_home):
    assert read_token() is None


@pytest.mark.parametrize("header, ok", [
    ("Bearer s3cret", True), ("bearer s3cret", True), ("Bearer  s3cret ", True), ("Bearer s3cre", False),
    ("Bearer s3cretx", False), ("s3cret", False), ("Basic s3cret", False), ("", False), (None, False),
    ("Bearer s3crét", False),
])
def test_the_token_check(header, ok):
    assert token_matches(header, "s3cret") is ok


def test_allowed_hosts_are_this_servers_names_with_its_port():
    hosts = allowed_hosts("127.0.0.1", 8000)
    assert {"127.0.0.1:8000", "localhost:8000", "[::1]:8000"} <= hosts
    assert not {"localhost", "127.0.0.1", "localhost:8001", "evil.example:8000"} & hosts
    assert "myhost:8000" in allowed_hosts("0.0.0.0", 8000, ("MyHost",))
    assert "0.0.0.0:8000" not in allowed_hosts("0.0.0.0", 8000)
    assert "[::1]:9000" in allowed_hosts("::1", 9000)
    assert "localhost" in allowed_hosts("127.0.0.1", 80), "port 80 is left out of Host by clients"


def test_penalties_follow_openai_and_hugging_face():
    import torch

    from lodger.serve.engine import Penalties

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    history = Penalties(repetition=2.0).history([0, 1], 4)
    history.add(3)
    history.add(3)
    assert torch.equal(Penalties(repetition=2.0).apply(logits, history), torch.tensor([1.0, -2.0, 0.5, 1.5]))
    history = Penalties(frequency=0.5, presence=1.0).history([0, 1], 4)
    history.add(3)
    history.add(3)
    history.add(2)
    assert torch.equal(Penalties(frequency=0.5, presence=1.0).apply(logits, history),
                       torch.tensor([2.0, -1.0, -1.0, 1.0]))  # the prompt's tokens are not penalised
    plain = Penalties()
    assert plain.apply(logits, plain.history([0], 4)) is logits


def test_content_parts_are_joined_and_other_parts_named():
    message = Message(role="user", content=[{"type": "text", "text": "a "}, {"type": "text", "text": "b"}])
    assert message.as_template() == {"role": "user", "content": "a b"}
    assert Message(role="developer", content="x").as_template()["role"] == "system"
    with pytest.raises(ValidationError, match="input_audio"):
        Message(role="user", content=[{"type": "input_audio", "input_audio": {}}])
    with pytest.raises(ValidationError, match="needs a string `text`"):
        Message(role="user", content=[{"type": "text"}])
    request = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                          stream_options={"include_usage": True}, stop="END")
    assert request.include_usage() and request.stops() == ["END"]
