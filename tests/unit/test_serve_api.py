"""The request fields of the OpenAI API in-process (the tiny model, Starlette's test client), each
checked against the model itself or the official client's own types:

- `logprobs` / `top_logprobs` (chat) and `logprobs` + `echo` (completions) are the model's own
  log-softmax, token by token, in the shapes OpenAI answers; the prompt's log-likelihood as
  lm-eval's `local-completions` reads it, across the engine's prefill chunks;
- `response_format` json_object / json_schema answers parse and follow the schema;
- `tools` on a template that renders them come back as `tool_calls`; on one that does not, a 400;
- every field is supported, refused (400 naming it) or ignored as docs/serve.md says; bad values
  name their field, and the server answers the next request.
"""

from __future__ import annotations

import json

import pytest

from fixtures_lib import TOOL_RESPONSE_TEMPLATE

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(test client, engine) of the app on the base tiny model, without a token."""
    from fastapi.testclient import TestClient

    from lodger.model import model_folder, resolve_source
    from lodger.serve.app import create_app
    from lodger.serve.engine import Engine

    engine = Engine(model_folder(resolve_source(str(tiny_model_dir))))
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        yield client, engine


@pytest.fixture(scope="module")
def forward(served):
    """The model's log-softmax over a sequence of ids, every position (a plain forward pass)."""
    import torch

    _, engine = served

    def run(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(engine.base(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def post(client, path: str, **body) -> dict:
    response = client.post(path, json={"model": "base", **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_logprobs_are_the_models_own_in_openais_shape(served, forward):
    from openai.types.chat import ChatCompletion

    client, engine = served
    answer = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=3)
    parsed = ChatCompletion.model_validate(answer)  # the official client's own types
    content = parsed.choices[0].logprobs.content
    assert len(content) == answer["usage"]["completion_tokens"] == 6
    ids = engine.encode_chat(QUESTION)
    for entry in content:  # the greedy answer, token by token, through plain forward passes
        logprobs = forward(ids)[-1]
        token = int(logprobs.argmax())
        values, best = logprobs.topk(3)
        assert entry.token == engine.tokenizer.decode([token]) and bytes(entry.bytes) == entry.token.encode()
        assert entry.logprob == pytest.approx(float(logprobs[token]), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        # a token that is part of a character is named by its bytes, as OpenAI does
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [engine.vocabulary.token_bytes(i) for i in best.tolist()]
        assert all(t.token == bytes(t.bytes).decode() if not t.token.startswith("bytes:") else
                   t.token == "bytes:" + "".join(f"\\x{b:02x}" for b in t.bytes) for t in entry.top_logprobs)
        assert entry.top_logprobs[0].logprob == entry.logprob, "the likeliest token reports exactly its logprob"
        ids.append(token)
    assert "".join(c.token for c in content) == parsed.choices[0].message.content


def test_streamed_chat_logprobs_add_up_to_the_whole_answers(served):
    client, _ = served
    whole = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=5, logprobs=True, top_logprobs=1)
    response = client.post("/v1/chat/completions", json={"model": "base", "messages": QUESTION, "max_tokens": 5,
                                                         "logprobs": True, "top_logprobs": 1, "stream": True})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    streamed = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["content"]]
    assert streamed == whole["choices"][0]["logprobs"]["content"]


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs computes from one choice."""
    logprobs = choice["logprobs"]
    continuation = logprobs["token_logprobs"][ctxlen:-1]
    greedy = all(lp == max(top.values()) for lp, top in zip(continuation, logprobs["top_logprobs"][ctxlen:-1]))
    return sum(continuation), greedy


@pytest.mark.parametrize("chunk", [512, 3], ids=["one-pass", "prefill-in-chunks-of-3"])
def test_echo_logprobs_are_the_prompts_log_likelihood_as_lm_eval_reads_it(served, forward, monkeypatch, chunk):
    from lodger.serve import engine as engine_module

    client, engine = served
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", chunk)
    context = engine.tokenizer("Question: red cat. Answer:", add_special_tokens=False)["input_ids"]
    continuation = engine.tokenizer(" blue dog", add_special_tokens=False)["input_ids"]
    ids = context + continuation
    # lm-eval's request for a log-likelihood: token ids, echo, one logprob, one generated token
    answer = post(client, "/v1/completions", prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0,
                  seed=1234)
    # (the client's types say floats; OpenAI's echo, vLLM's and lm-eval's reading have null first)
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    expected = forward(ids)
    for i in range(1, len(ids)):
        assert logprobs["token_logprobs"][i] == pytest.approx(float(expected[i - 1, ids[i]]), abs=1e-4)
        assert max(logprobs["top_logprobs"][i].values()) == pytest.approx(float(expected[i - 1].max()), abs=1e-4)
    total, greedy = lm_eval_loglikelihood(choice, len(context))
    assert total == pytest.approx(float(sum(expected[i - 1, ids[i]] for i in range(len(context), len(ids)))),
                                  abs=1e-3)
    assert greedy == all(int(expected[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
    text = engine.tokenizer.decode(ids)
    assert choice["text"].startswith(text)
    assert [choice["text"][o:o + len(t)] for o, t in zip(logprobs["text_offset"], logprobs["tokens"])] == \
        logprobs["tokens"], "each token's text starts at its text_offset"
    # the same prompt as a string, and max_tokens=0: the prompt alone
    alone = post(client, "/v1/completions", prompt=text, max_tokens=0, echo=True, logprobs=0)
    assert alone["choices"][0]["text"] == text and alone["usage"]["completion_tokens"] == 0
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"][:-1])


def test_lm_evals_own_requests_and_readers_work(served, forward):
    """lm-eval's `local-completions` model: its payloads (log-likelihood and generation) as it builds
    them, and its own parse_logprobs / parse_generations on the answers."""
    from types import SimpleNamespace

    api = pytest.importorskip("lm_eval.models.openai_completions").LocalCompletionsAPI
    client, engine = served
    lm = SimpleNamespace(model="base", _max_gen_toks=8)
    context = engine.tokenizer("Question: red cat. Answer:", add_special_tokens=False)["input_ids"]
    ids = context + engine.tokenizer(" blue dog", add_special_tokens=False)["input_ids"]
    answer = client.post("/v1/completions", json=api._create_payload(lm, [ids], generate=False)).json()
    ((loglikelihood, greedy),) = api.parse_logprobs(answer, tokens=[ids], ctxlens=[len(context)])
    expected = forward(ids)
    assert loglikelihood == pytest.approx(float(sum(expected[i - 1, ids[i]] for i in range(len(context), len(ids)))),
                                          abs=1e-3)
    assert greedy == all(int(expected[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
    payload = api._create_payload(lm, [ids], generate=True, eos="<|im_end|>",
                                  gen_kwargs={"until": ["\n\n", "Question:", "Q:", "A:", "</s>"], "do_sample": False,
                                              "temperature": 0.0})
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == 200, response.text
    (text,) = api.parse_generations(response.json())
    assert text == post(client, "/v1/completions", prompt=ids, max_tokens=8, temperature=0,
                        stop=payload["stop"])["choices"][0]["text"]


def test_several_prompts_answer_in_order_like_each_alone(served):
    client, _ = served
    both = post(client, "/v1/completions", prompt=["red cat", "blue dog"], max_tokens=4, temperature=0)
    alone = [post(client, "/v1/completions", prompt=p, max_tokens=4, temperature=0)["choices"][0]["text"]
             for p in ("red cat", "blue dog")]
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["text"] for c in both["choices"]] == alone


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9},
                                          "colour": {"enum": ["red", "blue"]}},
          "required": ["ok", "n", "colour"], "additionalProperties": False}


def test_response_format_json_answers_parse_and_follow_the_schema(served):
    client, _ = served
    plain = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=40)["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(plain)  # precondition: unconstrained, this model does not write JSON
    for seed in (1, 2, 3):
        answer = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=60, temperature=1.0, seed=seed,
                      response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}})
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"ok", "n", "colour"} and isinstance(value["ok"], bool), value
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 9 and value["colour"] in ("red", "blue"), value
    # json_object: greedy, this model closes the object at once; sampled (seed 11), it writes 89 tokens of
    # keys and values first (measured). Either way the whole answer parses and the model ended it itself.
    objects = []
    for sampling in ({}, {"temperature": 0.7, "seed": 11}):
        answer = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=200,
                      response_format={"type": "json_object"}, **sampling)
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", (sampling, choice)
        objects.append(json.loads(choice["message"]["content"]))
        assert isinstance(objects[-1], dict), (sampling, choice)
    assert objects[0] == {} and len(objects[1]) >= 1, objects


def test_logit_bias_moves_the_answer(served):
    client, engine = served
    token = engine.tokenizer("fish", add_special_tokens=False)["input_ids"][0]
    answer = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=3, logit_bias={str(token): 100})
    assert answer["choices"][0]["message"]["content"] == engine.tokenizer.decode([token] * 3)


def test_ignored_fields_are_accepted_and_change_nothing(served):
    client, _ = served
    plain = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=4)
    ignored = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=4, user="u-1", metadata={"a": "b"},
                   store=False, service_tier="auto", safety_identifier="s", prompt_cache_key="k", n=1,
                   modalities=["text"], stream_options=None, parallel_tool_calls=None,
                   prediction={"type": "content", "content": "x"})
    assert ignored["choices"][0]["message"] == plain["choices"][0]["message"]


BAD = [
    # (case, path, fields merged into a valid request, param the 400 names)
    ("unknown field", "/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("unknown field in a message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x", "weight": 2}]}, "messages.0.weight"),
    ("top_logprobs above 20", "/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("a schema that does not compile", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ("a dangling $ref", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema"),
    ("a bad pattern", "/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(("}}}}, "response_format.json_schema.schema"),
    ("json_schema without a schema block", "/v1/chat/completions", {"response_format": {"type": "json_schema"}},
     "response_format"),
    ("an unknown response_format", "/v1/chat/completions", {"response_format": {"type": "yaml"}},
     "response_format.type"),
    ("a tool without a name", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"description": "weather"}}]}, "tools.0.function.name"),
    ("a tool with a bad name", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools.0.function.name"),
    ("tool parameters that do not compile", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
     "tools.0.function.parameters"),
    ("tools on a template without tools", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
     "tools"),
    ("tool_choice without tools", "/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("a tool message on a template without tools", "/v1/chat/completions",
     {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "c1", "content": "5"}]}, "messages"),
    ("audio", "/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("the deprecated functions", "/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("store true", "/v1/chat/completions", {"store": True}, "store"),
    ("reasoning_effort", "/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("logit_bias outside the vocabulary", "/v1/chat/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("logit_bias not a token id", "/v1/chat/completions", {"logit_bias": {"fish": 5}}, "logit_bias"),
    ("logit_bias too strong", "/v1/chat/completions", {"logit_bias": {"5": 500}}, "logit_bias.5"),
    ("33 stop strings", "/v1/chat/completions", {"stop": [f"s{i}" for i in range(33)]}, "stop"),
    ("a seed beyond 64 bits", "/v1/chat/completions", {"seed": 2**70}, "seed"),
    ("legacy logprobs above 5", "/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("legacy logprobs a bool", "/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("token ids outside the vocabulary", "/v1/completions", {"prompt": [[1, 999999]]}, "prompt"),
    ("an empty prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("several prompts streamed", "/v1/completions", {"prompt": ["a", "b"], "stream": True}, "prompt"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("best_of 2", "/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("a chat field on completions", "/v1/completions", {"prompt": "x", "response_format": {"type": "text"}},
     "response_format"),
]


def test_a_body_nested_past_pythons_stack_is_a_400(served):
    client, _ = served
    nested = b'{"model": "base", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = client.post("/v1/chat/completions", content=nested, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", response.text


@pytest.mark.parametrize("case, path, fields, param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_field_is_a_400_naming_it_and_the_server_goes_on(served, case, path, fields, param):
    client, _ = served
    base = {"messages": QUESTION} if path.endswith("chat/completions") else {}
    response = client.post(path, json={"model": "base", "max_tokens": 2, **base, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=1)["choices"]


# -- tools on a template that renders them --------------------------------------------------------

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RESPONSE_TEMPLATE = TOOL_RESPONSE_TEMPLATE  # transformers' response parsing, in the shape of its Qwen2 template
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture
def tool_model(served, monkeypatch):
    """The served engine with a template that renders tools, answering ``said[0]`` whatever it is asked."""
    from lodger.serve.decode import Piece

    client, engine = served
    monkeypatch.setattr(engine.tokenizer, "chat_template", TOOL_TEMPLATE)
    monkeypatch.setattr(engine.tokenizer, "response_template", RESPONSE_TEMPLATE, raising=False)
    said, prompts = [""], []

    def stream(slot, ids, *, max_tokens, rules, stop, stats=None, echo=None):
        prompts.append(engine.tokenizer.decode(ids))
        stats["completion_tokens"] = 7
        yield Piece(said[0], "stop", "base")

    monkeypatch.setattr(engine, "stream", stream)
    return client, said, prompts


def test_tool_calls_are_parsed_from_the_templates_format(tool_model):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client, said, prompts = tool_model
    said[0] = 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}</tool_call>'
    answer = post(client, "/v1/chat/completions", messages=QUESTION, tools=[WEATHER], tool_choice="auto")
    assert '"get_weather"' in prompts[-1], "the tools are in the prompt the model sees"
    choice = ChatCompletion.model_validate(answer).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}, "cast by the tool's schema"

    response = client.post("/v1/chat/completions", json={"model": "base", "messages": QUESTION, "tools": [WEATHER],
                                                         "stream": True})
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in response.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c.choices[0].delta for c in chunks]
    assert [d.tool_calls[0].function.name for d in deltas if d.tool_calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    follow_up = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    said[0] = "It is sunny."
    answer = post(client, "/v1/chat/completions", messages=follow_up, tools=[WEATHER])
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert answer["choices"][0]["finish_reason"] == "stop" and "sunny" in prompts[-1]


@pytest.mark.parametrize("said", ['<tool_call>{"name": "get_weather", "argu',
                                  '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'],
                         ids=["a call cut short", "a tool that was not offered"])
def test_an_answer_that_does_not_parse_as_a_call_stays_text(tool_model, said):
    client, spoken, _ = tool_model
    spoken[0] = said
    answer = post(client, "/v1/chat/completions", messages=QUESTION, tools=[WEATHER])
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": said}
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_none_renders_no_tools_and_forcing_a_call_is_refused(tool_model):
    client, said, prompts = tool_model
    said[0] = "Five."
    post(client, "/v1/chat/completions", messages=QUESTION, tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in prompts[-1]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = client.post("/v1/chat/completions", json={"model": "base", "messages": QUESTION,
                                                             "tools": [WEATHER], "tool_choice": choice})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", response.text
    response = client.post("/v1/chat/completions", json={"model": "base", "messages": QUESTION, "tools": [WEATHER],
                                                         "response_format": {"type": "json_object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format", response.text


def test_a_template_that_renders_tools_without_a_response_template_is_refused(served, monkeypatch):
    client, engine = served
    monkeypatch.setattr(engine.tokenizer, "chat_template", TOOL_TEMPLATE)
    monkeypatch.setattr(engine.tokenizer, "response_template", None, raising=False)
    response = client.post("/v1/chat/completions", json={"model": "base", "messages": QUESTION, "tools": [WEATHER]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "response_template" in error["message"], error


def test_a_conversation_the_template_refuses_is_a_400_naming_messages(served, monkeypatch):
    client, engine = served
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    response = client.post("/v1/chat/completions", json={"model": "base", "messages": QUESTION})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "roles must alternate" in error["message"], error
