"""The port of Ollama's Modelfile parser (tests/modelfile_grammar.py) gives the answers Ollama's own
tests expect: cases copied from parser/parser_test.go at commit fb30760996871fa9460115c753afd2c60d4ab0f7
(TestParseFileFile, TestParseFileTrimSpace, TestParseFileFrom, TestParseFileParametersMissingValue,
TestParseFileBadCommand, TestParseFileMessages, TestParseFileQuoted, TestParseFileParameters,
TestParseFileComments, TestParseFileUTF16ParseFile, TestParseMultiByte)."""

from __future__ import annotations

import pytest

from modelfile_grammar import Command, ModelfileError, create_request, parse_file, render_template

LLAMA3 = ('{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}'
          '{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}'
          '<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>')


def test_a_whole_file_parses_into_ollamas_commands():
    text = ("\nFROM model1\nADAPTER adapter1\nLICENSE MIT\nPARAMETER param1 value1\nPARAMETER param2 value2\n"
            f'TEMPLATE """{LLAMA3}"""    \n')
    assert parse_file(text) == [Command("model", "model1"), Command("adapter", "adapter1"), Command("license", "MIT"),
                                Command("param1", "value1"), Command("param2", "value2"), Command("template", LLAMA3)]


def test_values_are_trimmed_outside_quotes_and_kept_inside():
    text = ('\nFROM "     model 1"\nADAPTER      adapter3\nLICENSE "MIT       "\nPARAMETER param1        value1\n'
            f'TEMPLATE """   {LLAMA3}   """    \n')
    assert parse_file(text) == [Command("model", "     model 1"), Command("adapter", "adapter3"),
                                Command("license", "MIT       "), Command("param1", "value1"),
                                Command("template", f"   {LLAMA3}   ")]


@pytest.mark.parametrize("text,expected", [
    ('FROM "FOO  BAR  "', [Command("model", "FOO  BAR  ")]),
    ('FROM "FOO BAR"\nPARAMETER param1 value1', [Command("model", "FOO BAR"), Command("param1", "value1")]),
    ("FROM     FOOO BAR    ", [Command("model", "FOOO BAR")]),
    ("FROM /what/is/the path ", [Command("model", "/what/is/the path")]),
    ("FROM llama3:7b-instruct-q4_K_M", [Command("model", "llama3:7b-instruct-q4_K_M")]),
    ("PARAMETER param1 value1\nFROM foo", [Command("param1", "value1"), Command("model", "foo")]),
    ("PARAMETER what the \nFROM lemons make lemonade ", [Command("what", "the"),
                                                         Command("model", "lemons make lemonade")]),
    ("\n# comment\nFROM foo\n\t", [Command("model", "foo")]),
    ("FROM foo\nMESSAGE system You are a file parser. Always parse things.\nMESSAGE user Hey there!\n",
     [Command("model", "foo"), Command("message", "system: You are a file parser. Always parse things."),
      Command("message", "user: Hey there!")]),
    ('\nFROM foo\nMESSAGE system """\nYou are a multiline file parser. Always parse things.\n"""\n\t\t\t',
     [Command("model", "foo"), Command("message", "system: \nYou are a multiline file parser. Always parse things.\n")]),
    ('\nFROM foo\nSYSTEM """\nThis is a\nmultiline system."""\n\t\t\t',
     [Command("model", "foo"), Command("system", "\nThis is a\nmultiline system.")]),
    ('\nFROM foo\nSYSTEM """\nThis is a multiline system with "quotes".\n"""\n',
     [Command("model", "foo"), Command("system", '\nThis is a multiline system with "quotes".\n')]),
    ('\nFROM foo\nSYSTEM """"""\n', [Command("model", "foo"), Command("system", "")]),
    ('\nFROM foo\nSYSTEM """\'\'"\'""\'""\'"\'\'\'\'\'""\'""\'"""\n',
     [Command("model", "foo"), Command("system", '\'\'"\'""\'""\'"\'\'\'\'\'""\'""\'')]),
    ('\nFROM foo\nTEMPLATE """\n{{ .Prompt }}\n"""', [Command("model", "foo"), Command("template", "\n{{ .Prompt }}\n")]),
    ("FROM test\n\tSYSTEM 你好👋", [Command("model", "test"), Command("system", "你好👋")]),
])
def test_ollamas_from_message_quote_and_comment_cases_parse_as_ollama_expects(text, expected):
    assert parse_file(text) == expected


@pytest.mark.parametrize("line,name,value", [
    ("num_ctx 1", "num_ctx", "1"), ("stop ### User:", "stop", "### User:"), ("stop ### User: ", "stop", "### User:"),
    ('stop "### User: "', "stop", "### User: "), ('stop """### User:\n"""', "stop", "### User:\n"),
    ("stop <|eot_id|>", "stop", "<|eot_id|>"), ("penalize_newline true", "penalize_newline", "true"),
])
def test_parameter_lines_parse_as_ollama_expects(line, name, value):
    assert parse_file(f"FROM foo\nPARAMETER {line}\n") == [Command("model", "foo"), Command(name, value)]


@pytest.mark.parametrize("text,kind,line", [
    ("", "missing_from", 0),
    ("PARAMETER param1 value1", "missing_from", 0),
    ("\nFROM foo\nPARAMETER param1\n", "unexpected_eof", 0),
    ("\nFROM foo\nBADCOMMAND param1 value1\n", "invalid_command", 3),
    ("\nFROM foo\nMESSAGE badguy I'm a bad guy!\n", "invalid_role", 3),
    ("\nFROM foo\nMESSAGE system\n", "unexpected_eof", 0),
    ('\nFROM foo\nSYSTEM """This is a multiline system.""\n\t\t\t', "unexpected_eof", 0),
    ('\nFROM foo\nSYSTEM "\n\t\t\t', "unexpected_eof", 0),
])
def test_ollamas_error_cases_are_errors_of_the_same_kind(text, kind, line):
    with pytest.raises(ModelfileError) as err:
        parse_file(text)
    assert err.value.kind == kind and err.value.line == line


@pytest.mark.parametrize("bom,codec", [(b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be")])
def test_a_utf16_file_with_its_bom_parses(bom, codec):
    data = bom + "FROM bob\nPARAMETER param1 1\nSYSTEM You are a utf16 file.\n".encode(codec)
    assert parse_file(data) == [Command("model", "bob"), Command("param1", "1"),
                                Command("system", "You are a utf16 file.")]


def test_create_request_types_parameters_and_collects_stop_lines(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    req = create_request(parse_file('FROM ./m.gguf\nPARAMETER stop "<|a|>"\nPARAMETER stop <|b|>\n'
                                    "PARAMETER temperature 0.5\nPARAMETER num_ctx 2048\n"), tmp_path)
    assert req.files == [tmp_path / "m.gguf"] and req.from_name is None
    assert req.parameters == {"stop": ["<|a|>", "<|b|>"], "temperature": 0.5, "num_ctx": 2048}
    assert create_request(parse_file("FROM llama3\n"), tmp_path).from_name == "llama3"
    for bad, words in (("PARAMETER stopp x", "unknown parameter 'stopp'"), ("PARAMETER num_ctx big", "invalid int")):
        with pytest.raises(ModelfileError, match=words):
            create_request(parse_file(f"FROM foo\n{bad}\n"), tmp_path)


def test_a_chatml_template_renders_the_conversation_with_the_system_prompt_first():
    template = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                "<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "hi"}]
    assert render_template(template, messages, "Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Mine."}, *messages]
    assert render_template(template, own, "Be brief.").startswith("<|im_start|>system\nMine.<|im_end|>")
    with pytest.raises(ModelfileError, match="outside the subset"):
        render_template("{{ range $i, $m := .Messages }}{{ end }}", messages, None)
