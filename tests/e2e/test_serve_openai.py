"""The OpenAI API as its clients use it, through the official `openai` client and raw HTTP.

- `content` as a list of text parts answers as the same text as a string; images get a clear 400.
- `models.retrieve`, and /health, /v1/models and the chat endpoint agree on the names.
- `stream_options.include_usage`: a last chunk with the usage, `usage: null` on the others.
- Errors parse as the client's exception classes; a corpus of bad requests each gets a 4xx in
  OpenAI's shape and leaves no traceback in the server's stderr.
- One log line per request; the penalties are honoured, checked against Hugging Face's
  repetition penalty and against a plain greedy loop written here.
- The three requests that used to be answered as if their field were absent: `logprobs` with
  `top_logprobs`, `response_format` and `tools` (tests/unit/test_serve_api.py checks each field
  against the model in-process; here the official client reads them over HTTP).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers import wait_until
from serve_helpers import QUESTION, Server, assert_error


@pytest.fixture(scope="module")
def api(baseline_server) -> tuple[Server, str]:
    """(server, run id): `lodger serve --run BASELINE` on a copy of the baseline's home, the server
    test_serve.py uses too (conftest); every check here reads only the log lines of its own requests."""
    server, run_id, _ = baseline_server
    return server, run_id


def test_content_as_text_parts_answers_like_a_string(api):
    server, run_id = api
    client = server.client()
    text = client.chat.completions.create(model=run_id, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "What is 2 + 3?"}])
    parts = client.chat.completions.create(model=run_id, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]}])
    assert parts.choices[0].message.content == text.choices[0].message.content
    assert parts.usage.prompt_tokens == text.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=run_id, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert "image_url" in refused.value.message and "text" in refused.value.message, refused.value.message


def test_models_retrieve_and_every_listed_name_is_accepted(api):
    server, run_id = api
    client = server.client()
    listed = [m.id for m in client.models.list().data]
    assert server.get("/health").json()["models"] == listed == ["base", run_id]
    for name in listed:
        model = client.models.retrieve(name)
        assert model.id == name and model.object == "model" and model.owned_by == "lodger"
        assert client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1).model == name
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(f"{run_id}@step-00000001")
    assert missing.value.code == "model_not_found"


def test_streaming_with_include_usage_ends_with_the_usage(api):
    server, run_id = api
    client = server.client()
    whole = client.chat.completions.create(model=run_id, messages=QUESTION, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=run_id, messages=QUESTION, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert last.usage.model_dump() == whole.usage.model_dump(), (last.usage, whole.usage)
    assert all(c.usage is None for c in content)
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    plain = list(client.chat.completions.create(model=run_id, messages=QUESTION, max_tokens=6, temperature=0,
                                                stream=True))
    assert all(c.choices and c.usage is None for c in plain), "no usage chunk unless asked for"


def test_errors_parse_as_the_clients_exception_classes(api):
    server, run_id = api
    client = server.client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    with pytest.raises(openai.AuthenticationError) as unauthorised:
        server.client("not-the-token").chat.completions.create(model=run_id, messages=QUESTION)
    assert unauthorised.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        client.get("/no/such/endpoint", cast_to=object)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=run_id, messages=QUESTION, frequency_penalty=3)
    assert bad.value.param == "frequency_penalty"


# -- bad requests: each a 4xx in OpenAI's shape, no traceback ------------------------------------------

OK = {"messages": QUESTION}
BAD_REQUESTS = [
    # (case, method, path, body: dict (merged into a valid chat request) or bytes, status, param)
    ("bad JSON", "POST", "/v1/chat/completions", b'{"model": "base", "messages": [}', 400, None),
    ("not UTF-8", "POST", "/v1/chat/completions", b"\xff\xfe not utf-8", 400, None),
    ("a JSON list", "POST", "/v1/chat/completions", b'["a list"]', 400, None),
    ("messages a string", "POST", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("temperature a word", "POST", "/v1/chat/completions", {"temperature": "hot"}, 400, "temperature"),
    ("max_tokens a float", "POST", "/v1/chat/completions", {"max_tokens": 2.5}, 400, "max_tokens"),
    ("content a number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400,
     None),
    ("unknown model", "POST", "/v1/chat/completions", {"model": "no-such-model"}, 404, "model"),
    ("an image part", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]}, 400, "messages.0.content"),
    ("a text part without text", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content"),
    ("huge max_tokens", "POST", "/v1/chat/completions", {"max_tokens": 10**9}, 400, "messages"),
    ("negative temperature", "POST", "/v1/chat/completions", {"temperature": -0.5}, 400, "temperature"),
    ("missing messages", "POST", "/v1/chat/completions", {"messages": None}, 400, "messages"),
    ("no model", "POST", "/v1/chat/completions", {"model": None}, 400, "model"),
    ("presence_penalty too big", "POST", "/v1/chat/completions", {"presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("repetition_penalty zero", "POST", "/v1/chat/completions", {"repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("stream_options a string", "POST", "/v1/chat/completions", {"stream_options": "yes"}, 400, "stream_options"),
    ("completion without prompt", "POST", "/v1/completions", {"messages": None}, 400, "prompt"),
    ("GET on chat", "GET", "/v1/chat/completions", None, 405, None),
    ("DELETE a model", "DELETE", "/v1/models/base", None, 405, None),
    ("POST on models", "POST", "/v1/models", {}, 405, None),
    ("unknown endpoint", "POST", "/v1/embeddings", {}, 404, None),
    ("an unknown field", "POST", "/v1/chat/completions", {"frobnicate": True}, 400, "frobnicate"),
    ("top_logprobs above the limit", "POST", "/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("a schema that does not compile", "POST", "/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 7}}}}, 400,
     "response_format.json_schema.schema"),
    ("a tool without a name", "POST", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, 400, "tools.0.function.name"),
    ("legacy logprobs above 5", "POST", "/v1/completions", {"messages": None, "prompt": "x", "logprobs": 9}, 400,
     "logprobs"),
]


def test_the_bad_request_corpus_is_large_enough():
    print(f"{len(BAD_REQUESTS)} bad HTTP requests in the corpus")
    assert len(BAD_REQUESTS) >= 8


@pytest.mark.parametrize("case, method, path, body, status, param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_a_bad_request_gets_an_openai_error_and_no_traceback(api, case, method, path, body, status, param):
    server, run_id = api
    if isinstance(body, dict):
        merged = {"model": run_id, **OK, **body}
        body = httpx.Request("POST", "/", json={k: v for k, v in merged.items() if v is not None}).read()
    before = server.stderr()
    response = httpx.request(method, server.url + path, content=body, timeout=120,
                             headers={"content-type": "application/json", **server.auth})
    assert_error(response, status, param=param)
    assert 400 <= response.status_code < 500
    line = f"{method} {path} {status}"
    wait_until(lambda: line in server.stderr()[len(before):], 30, what=f"the log line `{line}`")
    new = server.stderr()[len(before):]
    assert "Traceback" not in new, new
    assert server.client().chat.completions.create(model=run_id, messages=QUESTION, max_tokens=1).choices


# -- logprobs, response_format, tools ----------------------------------------------------------------

def test_logprobs_json_and_tools_are_answered_or_refused_never_ignored(api):
    server, run_id = api
    client = server.client()
    answer = client.chat.completions.create(model=run_id, messages=QUESTION, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens and "".join(t.token for t in content) == \
        answer.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)

    prompt = client.completions.create(model=run_id, prompt="Question: What is 2 + 3?\nAnswer: 5", max_tokens=1,
                                       echo=True, logprobs=1, temperature=0)
    logprobs = prompt.choices[0].logprobs
    assert len(logprobs.tokens) == prompt.usage.prompt_tokens + 1 and logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:]) and len(logprobs.text_offset) == len(logprobs.tokens)
    assert prompt.choices[0].text.startswith("Question: What is 2 + 3?\nAnswer: 5")

    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer"], "additionalProperties": False}
    shaped = client.chat.completions.create(model=run_id, messages=QUESTION, max_tokens=20, temperature=0,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "sum", "schema": schema}})
    value = json.loads(shaped.choices[0].message.content)
    assert set(value) == {"answer"} and 0 <= value["answer"] <= 9, value

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=run_id, messages=QUESTION, tools=[
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    assert refused.value.param == "tools" and "template" in refused.value.message


# -- the log line ---------------------------------------------------------------------------------------

def test_each_request_is_logged_once_with_status_tokens_latency_and_holding(api):
    server, run_id = api
    before = server.stderr()
    answer = server.client().chat.completions.create(model=run_id, messages=QUESTION, max_tokens=3)
    wanted = (f"POST /v1/chat/completions 200 model={run_id} prompt={answer.usage.prompt_tokens} "
              f"completion={answer.usage.completion_tokens} ")

    def logged() -> list[str]:
        return [line for line in server.stderr()[len(before):].splitlines() if "/v1/" in line]

    lines = wait_until(logged, 30, what="the request's log line")
    assert len(lines) == 1 and wanted in lines[0] and " ms held=none" in lines[0], lines


# -- penalties -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """(model, tokenizer, prompt ids of QUESTION) of the base model, loaded here."""
    import torch

    from lodger.model import load_base_model, load_tokenizer, model_folder, resolve_source

    folder = model_folder(resolve_source(str(tiny_model_dir)))
    tokenizer, model = load_tokenizer(folder), load_base_model(folder).eval()
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # for this module's reference loops only: later tests train in this process
    yield model, tokenizer, ids
    torch.set_grad_enabled(previous)


def greedy(model, tokenizer, ids: list[int], steps: int, frequency=0.0, presence=0.0) -> str:
    """A plain greedy loop (no cache) with OpenAI's penalties on the answer's own tokens."""
    import torch

    produced: list[int] = []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids + produced])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(produced, dtype=torch.long), minlength=logits.shape[0]).float() \
            if produced else torch.zeros_like(logits)
        token = int(torch.argmax(logits - counts * frequency - (counts > 0).float() * presence))
        if token == tokenizer.eos_token_id:
            break
        produced.append(token)
    return tokenizer.decode(produced, skip_special_tokens=True)


def test_frequency_and_presence_penalties_are_honoured(api, reference):
    server, _ = api
    model, tokenizer, ids = reference
    client = server.client()
    plain = greedy(model, tokenizer, ids, 24)
    for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}):
        expected = greedy(model, tokenizer, ids, 24, kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0))
        assert expected != plain, f"precondition: {kw} changes this model's greedy answer"
        answer = client.chat.completions.create(model="base", messages=QUESTION, max_tokens=24, temperature=0, **kw)
        assert answer.choices[0].message.content == expected, kw


def test_the_repetition_penalty_matches_hugging_face(api, reference):
    import torch

    server, _ = api
    model, tokenizer, ids = reference

    def hf(penalty: float) -> str:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, repetition_penalty=penalty,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    assert hf(1.8) != hf(1.0), "precondition: the penalty changes this model's greedy answer"
    answer = server.client().chat.completions.create(model="base", messages=QUESTION, max_tokens=24, temperature=0,
                                                     extra_body={"repetition_penalty": 1.8})
    assert answer.choices[0].message.content == hf(1.8)
