"""Data: JSONL validation, chat loss masking by position, the token cache, the sampler and the split."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from lodger.data.chats import Sampler, collate, encode_row, read_jsonl, split_indices, tokenize
from lodger.errors import DataError
from lodger.model import load_tokenizer

GOOD_CHAT = {"messages": [{"role": "user", "content": "What is 1 + 2?"},
                          {"role": "assistant", "content": "1 + 2 = 3."}]}
GOOD_TEXT = {"text": "Question: hi\nAnswer: hello"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# -- validation ---------------------------------------------------------------------------------

BAD_LINES = {
    "invalid JSON": ('{"messages": [', "not valid JSON"),
    "neither messages nor text": ('{"prompt": "hi", "completion": "there"}', 'exactly one of "messages"'),
    "both messages and text": (json.dumps({**GOOD_CHAT, **GOOD_TEXT}), 'exactly one of "messages"'),
    "not an object": ('["text", "hi"]', "expected a JSON object"),
    "empty text": ('{"text": "   "}', '"text" must be a non-empty string'),
    "bad role": (json.dumps({"messages": [{"role": "human", "content": "hi"},
                                          {"role": "assistant", "content": "yo"}]}), "messages[0].role is 'human'"),
    "no assistant message": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                             "at least one non-empty assistant message"),
    "only an empty assistant message": (json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": ""}]}),
                                        "at least one non-empty assistant message"),
    "non-string content": (json.dumps({"messages": [{"role": "user", "content": ["hi"]},
                                                    {"role": "assistant", "content": "yo"}]}),
                           "messages[0].content must be a string"),
    "empty messages": ('{"messages": []}', '"messages" must be a non-empty list'),
    "unknown message field": (json.dumps({"messages": [{"role": "user", "content": "hi", "mood": "happy"},
                                                       {"role": "assistant", "content": "yo"}]}),
                              'messages[0] must be an object with "role" and "content"'),
}


@pytest.mark.parametrize("line, reason", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_bad_line_is_reported_with_file_and_line_number(tmp_path: Path, line: str, reason: str) -> None:
    path = write_lines(tmp_path / "train.jsonl", [json.dumps(GOOD_CHAT), "", line, json.dumps(GOOD_TEXT)])
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    message = str(info.value)
    assert f"{path}:3: " in message
    assert reason in message
    assert "1 bad line(s)" in message
    assert f"{path}:1" not in message and f"{path}:4" not in message


def test_every_bad_line_is_listed_in_one_error_up_to_ten(tmp_path: Path) -> None:
    lines = [json.dumps(GOOD_TEXT) if i % 2 else "{oops" for i in range(30)]  # bad on odd line numbers
    path = write_lines(tmp_path / "train.jsonl", lines)
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    message = str(info.value)
    assert "15 bad line(s)" in message
    assert [f"{path}:{n}:" in message for n in range(1, 30, 2)] == [True] * 10 + [False] * 5
    assert "and 5 more" in message


def test_an_empty_or_missing_data_file_is_an_error_naming_it(tmp_path: Path) -> None:
    empty = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match=f"{empty}: no examples"):
        read_jsonl(empty)
    with pytest.raises(DataError, match=str(tmp_path / "absent.jsonl")):
        read_jsonl(tmp_path / "absent.jsonl")


def test_good_lines_keep_their_line_numbers_and_the_file_identity(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "train.jsonl", ["", json.dumps(GOOD_CHAT), "", json.dumps(GOOD_TEXT)])
    data = read_jsonl(path)
    assert [row["line"] for row in data.rows] == [2, 4]
    assert data.rows[0]["messages"] == GOOD_CHAT["messages"] and data.rows[1]["text"] == GOOD_TEXT["text"]
    assert data.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and data.size == path.stat().st_size


def test_invalid_utf8_is_an_error_naming_file_line_and_byte_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(GOOD_TEXT).encode() + b'\n{"text": "caf\xe9"}\n' + json.dumps(GOOD_TEXT).encode())
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    assert f"{path}:2: not valid UTF-8 (byte 0xe9 at byte 14 of the line)" in str(info.value)
    assert "1 bad line(s)" in str(info.value)


def test_a_rows_own_line_key_is_ignored_like_other_metadata(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "train.jsonl", ["", json.dumps({**GOOD_TEXT, "line": "seven", "id": 3})])
    [row] = read_jsonl(path).rows
    assert row["line"] == 2 and row["text"] == GOOD_TEXT["text"]


def test_only_line_ends_split_lines_not_unicode_separators_inside_strings(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps({"text": "a\u2028b\x0cc"}, ensure_ascii=False).encode() + b"\r\n"
                     + json.dumps(GOOD_TEXT).encode() + b"\r")
    rows = read_jsonl(path).rows
    assert [(r["line"], r["text"]) for r in rows] == [(1, "a\u2028b\x0cc"), (2, GOOD_TEXT["text"])]


def test_brackets_inside_strings_and_wide_lists_are_not_nesting(tmp_path: Path) -> None:
    """500 brackets inside a string, 500 lists side by side, 100 deep: read; 101 deep: refused by depth"""
    lines = [{"text": "[{" * 500}, {"text": "ok", "meta": [[1]] * 500},
             {"text": "ok", "meta": json.loads("[" * 99 + "]" * 99)}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["line"] for r in read_jsonl(path).rows] == [1, 2, 3]
    path.write_text(path.read_text() + '{"text": "ok", "meta": ' + "[" * 100 + "]" * 100 + "}\n")
    with pytest.raises(DataError, match=r"d.jsonl:4: the JSON nests 101 deep"):
        read_jsonl(path)


def test_an_escaped_pair_is_one_character_and_only_a_lone_half_is_refused(tmp_path: Path) -> None:
    """\\ud83d\\ude00 reads as one emoji; \\ud83d alone is named with its line, key and place"""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude00"}\n')
    assert read_jsonl(path).rows[0]["text"] == "smile \U0001F600"
    path.write_text('{"text": "smile \\ud83d"}\n')
    with pytest.raises(DataError, match=r'd.jsonl:1: "text" holds a lone surrogate \(\\ud83d\) at character 7'):
        read_jsonl(path)


def test_the_fixture_data_files_validate(chat_data: dict, text_data: dict) -> None:
    assert len(read_jsonl(chat_data["train"]).rows) == 64
    assert len(read_jsonl(text_data["eval"]).rows) == 16


# -- loss masking ---------------------------------------------------------------------------------

CHAT = {"line": 7, "messages": [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": "1 + 2 = 3."},
    {"role": "user", "content": "Spell the word cat."},
    {"role": "assistant", "content": "c-a-t"},
]}


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, flag in zip(ids, mask):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_chat_loss_covers_each_assistant_reply_and_its_end_of_turn_token(tokenizer) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end == tokenizer.pad_token_id == tokenizer.eos_token_id  # the trap: masking by id would drop it
    ids, mask = encode_row(CHAT, tokenizer, 256, "chat.jsonl")
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    runs = masked_runs(ids, mask)
    replies = [m["content"] for m in CHAT["messages"] if m["role"] == "assistant"]
    assert len(runs) == len(replies)
    for run, reply in zip(runs, replies):
        assert tokenizer.decode(run).startswith(reply + "<|im_end|>")
        reply_tokens = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        assert run[reply_tokens] == end


def test_chat_loss_covers_none_of_the_system_or_user_tokens(tokenizer) -> None:
    ids, mask = encode_row(CHAT, tokenizer, 256, "chat.jsonl")
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    masked = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    for message in CHAT["messages"]:
        if message["role"] != "assistant":
            assert message["content"] in unmasked
            assert message["content"] not in masked
    assert "<|im_start|>" not in masked and "assistant" not in masked and "user" not in masked
    # every <|im_start|>role\n header, the assistant's included, carries no loss
    assert unmasked.count("<|im_start|>") == len(CHAT["messages"])


def test_the_default_system_prompt_a_template_injects_carries_no_loss(tokenizer) -> None:
    row = {"line": 1, "messages": CHAT["messages"][1:3]}
    ids, mask = encode_row(row, tokenizer, 256, "chat.jsonl")
    rendered = tokenizer.decode(ids)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert "helpful" not in tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_the_newline_after_the_end_of_turn_token_carries_no_loss(tokenizer) -> None:
    ids, mask = encode_row(CHAT, tokenizer, 256, "chat.jsonl")
    replies = [m["content"] for m in CHAT["messages"] if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in masked_runs(ids, mask)] == [r + "<|im_end|>" for r in replies]


def test_text_lines_train_on_every_token_and_end_with_eos(tokenizer) -> None:
    ids, mask = encode_row({"line": 1, **GOOD_TEXT}, tokenizer, 256, "text.jsonl")
    assert mask == [1] * len(ids)
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == GOOD_TEXT["text"]


def test_long_examples_are_truncated_to_max_length(tokenizer) -> None:
    ids, mask = encode_row({"line": 1, "text": "red blue green " * 40}, tokenizer, 16, "text.jsonl")
    assert len(ids) == len(mask) == 16
    ids, mask = encode_row(CHAT, tokenizer, 40, "chat.jsonl")
    assert len(ids) == 40 and any(mask)


def test_a_chat_whose_replies_are_all_cut_off_by_max_length_names_the_line(tokenizer) -> None:
    with pytest.raises(DataError, match=r"chat\.jsonl:7: no assistant token .*max_length = 8"):
        encode_row(CHAT, tokenizer, 8, "chat.jsonl")


def test_collate_pads_with_no_loss_but_keeps_the_end_of_turn_label(tokenizer, tmp_path: Path) -> None:
    short = {"messages": CHAT["messages"][1:3]}
    path = write_lines(tmp_path / "chat.jsonl", [json.dumps(short), json.dumps({"messages": CHAT["messages"]})])
    dataset = tokenize(read_jsonl(path), tokenizer, "tok", 256)
    batch = collate(dataset, [0, 1], tokenizer.pad_token_id)
    n_short = len(dataset.example(0)[0])
    assert n_short < batch["input_ids"].shape[1]
    end = tokenizer.eos_token_id
    assert (batch["input_ids"][0, n_short:] == end).all()  # right padding with the pad (= eos) id
    assert (batch["labels"][0, n_short:] == -100).all() and (batch["attention_mask"][0, n_short:] == 0).all()
    ids, mask = dataset.example(0)
    end_of_turn = [i for i in range(n_short) if ids[i] == end and mask[i]]
    assert end_of_turn and all(batch["labels"][0, i] == end for i in end_of_turn)
    for row in (0, 1):
        ids, mask = dataset.example(row)
        assert torch.equal(batch["labels"][row, : len(ids)], torch.where(mask.bool(), ids, torch.tensor(-100)))


# -- the token cache ------------------------------------------------------------------------------


def test_tokenize_caches_by_content_and_the_second_call_needs_no_tokenizer(tokenizer, chat_data: dict,
                                                                           lodger_home: Path) -> None:
    data = read_jsonl(chat_data["train"])
    first = tokenize(data, tokenizer, "tok-sha", 64)
    cached = list((lodger_home / "cache" / "tokens").glob("*.safetensors"))
    assert len(cached) == 1
    assert len(first) == 64 and first.tokens() > 0

    again = tokenize(data, None, "tok-sha", 64)  # no tokenizer: it can only come from the cache
    for name in ("ids", "mask", "offsets", "lines"):
        assert torch.equal(getattr(again, name), getattr(first, name)), name
    assert [torch.equal(a, b) for a, b in zip(again.example(5), first.example(5))] == [True, True]

    tokenize(data, tokenizer, "tok-sha", 128)  # another max length is another cache entry
    tokenize(data, tokenizer, "other-tokenizer", 64)  # and so is another tokenizer
    assert len(list((lodger_home / "cache" / "tokens").glob("*.safetensors"))) == 3


def test_a_damaged_token_cache_is_rebuilt_not_trusted(tokenizer, text_data: dict, lodger_home: Path) -> None:
    data = read_jsonl(text_data["train"])
    first = tokenize(data, tokenizer, "tok-sha", 64)
    (cached,) = (lodger_home / "cache" / "tokens").glob("*.safetensors")
    cached.write_bytes(cached.read_bytes()[:50])
    rebuilt = tokenize(data, tokenizer, "tok-sha", 64)
    assert torch.equal(rebuilt.ids, first.ids) and torch.equal(rebuilt.mask, first.mask)
    assert tokenize(data, None, "tok-sha", 64).ids.equal(first.ids)  # and cached again


def test_tokenized_examples_match_encode_row(tokenizer, chat_data: dict) -> None:
    data = read_jsonl(chat_data["train"])
    dataset = tokenize(data, tokenizer, "tok-sha", 96)
    for index in (0, 1, 2, 63):
        ids, mask = encode_row(data.rows[index], tokenizer, 96, str(data.path))
        got_ids, got_mask = dataset.example(index)
        assert got_ids.tolist() == ids and got_mask.tolist() == mask
    assert dataset.lines.tolist() == list(range(1, 65))


# -- sampler and split ----------------------------------------------------------------------------


def test_two_fresh_samplers_agree_at_any_position_in_any_order() -> None:
    indices = list(range(3, 40, 2))
    positions = [0, 5, 1234, 7, 19, 20, 99999, 3, 1234, 40]
    first = Sampler(indices, seed=11)
    expected = [first.at(p) for p in positions]
    for order in (positions, positions[::-1], sorted(positions)):
        fresh = Sampler(indices, seed=11)
        assert {p: fresh.at(p) for p in order} == dict(zip(positions, expected))
    jumped = Sampler(indices, seed=11)  # a resumed run jumps straight to its place
    sequential = Sampler(indices, seed=11)
    walked = [sequential.at(p) for p in range(1300)]
    assert [jumped.at(p) for p in range(1234, 1300)] == walked[1234:]


def test_each_epoch_is_a_permutation_of_the_indices_and_epochs_differ() -> None:
    indices = [5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987]
    sampler = Sampler(indices, seed=3)
    epochs = [[sampler.at(e * len(indices) + i) for i in range(len(indices))] for e in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(indices)
    assert len({tuple(e) for e in epochs}) == 4
    assert sampler.epoch_of(len(indices) * 2 + 6) == 2.5


def test_different_seeds_give_different_orders() -> None:
    indices = list(range(50))
    orders = {tuple(Sampler(indices, seed).at(p) for p in range(50)) for seed in range(5)}
    assert len(orders) == 5


def test_split_indices_is_deterministic_disjoint_and_complete() -> None:
    train, eval_ = split_indices(100, 0.1, seed=4)
    assert (train, eval_) == split_indices(100, 0.1, seed=4)
    assert len(eval_) == 10 and not set(train) & set(eval_)
    assert sorted(train + eval_) == list(range(100))
    assert train == sorted(train) and eval_ == sorted(eval_)
    assert split_indices(100, 0.1, seed=5)[1] != eval_


def test_split_indices_always_leaves_training_data_and_can_be_disabled() -> None:
    assert split_indices(10, 0.0, seed=0) == (list(range(10)), [])
    assert split_indices(1, 0.5, seed=0) == ([0], [])
    train, eval_ = split_indices(3, 0.99, seed=0)
    assert len(train) == 1 and len(eval_) == 2
    train, eval_ = split_indices(50, 0.001, seed=0)
    assert len(eval_) == 1 and len(train) == 49
