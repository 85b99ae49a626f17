"""`tools` end to end, through the model's own generation: a tiny model whose chat template renders
tools and whose tokenizer parses calls back (fixtures_lib.build_tool_model: random weights, then
taught three answers in the fixture), served by a real `lodger serve --model` on 127.0.0.1 and asked
by the official `openai` client. Nothing is stubbed: the call comes out of the model's greedy decode,
is parsed by transformers' response parsing, cast by the tool's schema and read by the client; the
call's result sent back gets the model's answer in words; `tool_choice: "none"` renders no tools.

(tests/unit/test_serve_api.py checks the parsing's edge cases with a stubbed generation: a call cut
short, a tool that was not offered, a template without tools.)"""

from __future__ import annotations

import json

import pytest

from fixtures_lib import WEATHER_QUESTION, WEATHER_TOOL, build_tool_model, tool_conversations
from helpers import lodger_env
from serve_helpers import start_server


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """(server, model folder): `lodger serve --model TOOL_MODEL`, with its token."""
    folder = build_tool_model(tmp_path_factory.mktemp("tool_model") / "model")
    env = lodger_env(tmp_path_factory.mktemp("tool_home"))
    env.pop("LODGER_API_TOKEN", None)
    server = start_server(["--model", str(folder), "--no-yield"], env, tmp_path_factory.mktemp("tool_logs"))
    yield server, folder
    server.close()


def test_the_model_calls_the_offered_tool_and_the_official_client_reads_the_call(tool_server):
    from transformers import AutoTokenizer

    server, folder = tool_server
    client = server.client()
    answer = client.chat.completions.create(model="base", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=128)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    # the model wrote "days": "3"; the tool's schema says integer
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}, call.function.arguments

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(WEATHER_QUESTION, tools=[WEATHER_TOOL], tokenize=False,
                                           add_generation_prompt=True)
    assert "Tools: get_weather" in prompt
    assert answer.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"]), \
        "the prompt the model saw is the one with the tools rendered"
    (taught,) = [a for m, t, a in tool_conversations() if t and m == WEATHER_QUESTION]
    assert answer.usage.completion_tokens == len(tokenizer(taught, add_special_tokens=False)["input_ids"]), \
        "the call is the model's own greedy answer, token for token (the end-of-turn token not counted)"

    chunks = list(client.chat.completions.create(model="base", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                                 temperature=0, max_tokens=128, stream=True))
    streamed = [d.tool_calls for d in (c.choices[0].delta for c in chunks if c.choices) if d.tool_calls]
    assert [[(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] for calls in streamed] == \
        [[(0, "get_weather", {"city": "Paris", "days": 3})]]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_calls_result_sent_back_gets_the_models_answer_in_words(tool_server):
    server, _ = tool_server
    client = server.client()
    first = client.chat.completions.create(model="base", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                           temperature=0, max_tokens=128)
    (call,) = first.choices[0].message.tool_calls
    follow_up = [*WEATHER_QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model="base", messages=follow_up, tools=[WEATHER_TOOL], temperature=0,
                                            max_tokens=128)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None, choice
    assert choice.message.content == "It is sunny in Paris."


def test_tool_choice_none_offers_no_tools_and_the_model_answers_in_words(tool_server):
    server, _ = tool_server
    answer = server.client().chat.completions.create(model="base", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                                     tool_choice="none", temperature=0, max_tokens=128)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None, choice
    assert choice.message.content == "I cannot look that up."
