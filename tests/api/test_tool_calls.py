"""Tool calls: the Llama 3 JSON, hermes, mistral, granite, glm45, minimax_m2, qwen3_coder and
seed_oss parsers, the stream filter that holds back what may be calls, and the forced-call constraint,
whose outputs under random weights always parse as a call whose arguments validate against the
function's schema (`jsonschema`)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.api.tool_calls import (
    StreamedCalls, find_tool_calls, forced_call_constraint, may_be_calls, offered, parse_glm45_calls,
    parse_granite_calls, parse_hermes_calls, parse_minimax_calls, parse_mistral_calls, parse_qwen3_coder_calls,
    parse_tool_calls,
)
from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams

WEATHER = {"name": "weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                             "properties": {"city": {"type": "string", "maxLength": 12}}}}
ADD = {"name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                                     "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}
NAMES = {"weather", "add"}


@pytest.mark.parametrize("text, expected", [
    ('{"name": "weather", "parameters": {"city": "Paris"}}', [("weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})]),
    (' {"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "weather", "parameters": {"city": "Oslo"}}\n',
     [("add", {"a": 1, "b": 2}), ("weather", {"city": "Oslo"})]),
])
def test_llama3_json_calls_parse(text, expected):
    calls = parse_tool_calls(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", ['{"name": "nope", "parameters": {}}', '{"name": "add"}', "Sure! The weather is",
                                  '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": []}',
                                  '{"name": "add", "parameters": {}} and more', ""])
def test_text_that_is_not_only_calls_stays_content(text):
    assert parse_tool_calls(text, NAMES) is None


def test_may_be_calls_decides_on_the_first_characters():
    assert may_be_calls("  ") is None and may_be_calls("<|pyth") is None
    assert may_be_calls(' {"na') and may_be_calls("<|python_tag|>{")
    assert may_be_calls("Hello") is False


def test_stream_filter_holds_back_calls_and_lets_text_through():
    calls = StreamedCalls(NAMES)
    assert calls.feed(" ", None) is None and calls.feed('{"name": "add", ', None) is None
    content, found, reason = calls.feed('"parameters": {"a": 1, "b": 2}}', "stop")
    assert (content, reason, found[0].name) == ("", "tool_calls", "add")
    text = StreamedCalls(NAMES)
    assert text.feed(" ", None) is None
    assert text.feed("Hi", None) == (" Hi", None, None) and text.feed(" there", "stop") == (" there", None, "stop")
    broken = StreamedCalls(NAMES)  # looked like a call, ran out of tokens: sent as the text it is
    assert broken.feed('{"name": "ad', None) is None and broken.feed("d", "length") == ('{"name": "add', None, "length")


@pytest.mark.parametrize("choice, names", [("required", {"weather", "add"}),
                                           ({"type": "function", "function": {"name": "add"}}, {"add"})])
def test_forced_calls_parse_and_validate_under_random_weights(choice, names):
    constraint = forced_call_constraint([WEATHER, ADD], choice)
    outputs = LLM("demo").generate(["call a tool"] * 8, [SamplingParams(max_tokens=80, seed=i, constraint=constraint)
                                                         for i in range(8)])
    schemas = {f["name"]: f["parameters"] for f in (WEATHER, ADD)}
    for out in outputs:
        assert out.finish_reason == "stop"
        [call] = parse_tool_calls(out.text, names)
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_auto_and_none_leave_the_model_free():
    assert forced_call_constraint([WEATHER], "auto") is None and forced_call_constraint([WEATHER], None) is None


# ---- the hermes format (Qwen2.5, Qwen3) ---------------------------------------------------------
HERMES = ('I will add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
          '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def test_hermes_calls_after_the_content_written_first():
    content, calls = parse_hermes_calls(HERMES, NAMES)
    assert content == "I will add them."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3}),
                                                                  ("weather", {"city": "Oslo"})]
    assert parse_hermes_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', NAMES)[0] is None  # cut at the close
    assert find_tool_calls(HERMES, NAMES, "hermes")[1][0].name == "add"


@pytest.mark.parametrize("text", ["no calls here", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
                                  '<tool_call>{"name": "add", "arguments": {}}</tool_call> and more words'])
def test_hermes_text_that_is_not_only_calls_after_the_tag_is_content(text):
    assert parse_hermes_calls(text, NAMES) is None and find_tool_calls(text, NAMES, "hermes") is None


def test_hermes_stream_sends_content_until_the_tag_then_the_calls():
    stream = StreamedCalls(NAMES, "hermes")
    pieces = [HERMES[i:i + 5] for i in range(0, len(HERMES), 5)]
    sent = [stream.feed(piece, "stop" if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]
    content = "".join(s[0] for s in sent if s is not None)
    *_, (_, calls, reason) = [s for s in sent if s is not None]
    assert content.strip() == "I will add them." and reason == "tool_calls"
    assert [c.name for c in calls] == ["add", "weather"]
    assert "<" not in content  # the tag's beginning was held, not streamed


def test_hermes_stream_that_ends_without_calls_sends_what_it_held():
    stream = StreamedCalls(NAMES, "hermes")
    assert stream.feed("a <tool", None) == ("a ", None, None)
    assert stream.feed("box> b", None) == ("<toolbox> b", None, None)
    assert stream.feed(' <tool_call>{"name": "add"', None) == (" ", None, None)
    assert stream.feed(', "argu', "length") == ('<tool_call>{"name": "add", "argu', None, "length")


# ---- the mistral format ------------------------------------------------------------------------
MISTRAL_V3 = ('Checking.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}, '
              '{"name": "weather", "arguments": {"city": "Oslo"}}]')
MISTRAL_V11 = ('Checking.[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}'
               '[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}')


@pytest.mark.parametrize("text", [MISTRAL_V3, MISTRAL_V11])
def test_mistral_calls_in_either_tokenizer_generation_with_ids_its_templates_take(text):
    content, calls = parse_mistral_calls(text, NAMES)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3}),
                                                                  ("weather", {"city": "Oslo"})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and calls[0].id != calls[1].id
    assert find_tool_calls(text.removeprefix("Checking."), NAMES, "mistral")[0] is None


NOT_CALLS = {"mistral": ["no calls here", "[TOOL_CALLS] []", "[TOOL_CALLS]nope[ARGS]{}", '[TOOL_CALLS]add[ARGS]{"a": ',
                         '[TOOL_CALLS]add{"a": 1}', '[TOOL_CALLS] [{"name": "add", "arguments": {}}] and more words',
                         '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]'],
             "granite": ["no calls here", "<|tool_call|>[]", '<|tool_call|>{"name": "add", "arguments": {}}',
                         '<|tool_call|>[{"name": "nope", "arguments": {}}]', '<|tool_call|>[{"name": "add"',
                         '<|tool_call|>[{"name": "add", "arguments": {}}] and more words',
                         '[{"name": "add", "arguments": {}}]']}


@pytest.mark.parametrize("parser, text", [(parser, text) for parser, texts in NOT_CALLS.items() for text in texts])
def test_text_that_is_not_only_calls_after_the_marker_is_content(parser, text):
    assert find_tool_calls(text, NAMES, parser) is None


def test_a_forced_call_served_for_mistral_gets_its_id_shape():
    """A forced call is the JSON format, but goes back to a Mistral template: its ids too."""
    [call] = find_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', NAMES, "llama3_json", "mistral")[1]
    assert len(call.id) == 9 and call.id.isalnum()
    assert find_tool_calls('{"name": "add", "parameters": {}}', NAMES, "llama3_json")[1][0].id.startswith("call_")


# ---- the granite format ------------------------------------------------------------------------
GRANITE = ('Checking.<|tool_call|>[{"name": "add", "arguments": {"a": 2, "b": 3}}, '
           '{"name": "weather", "arguments": {"city": "Oslo"}}]')


def test_granite_calls_after_its_tag():
    content, calls = parse_granite_calls(GRANITE, NAMES)
    assert (content, [c.name for c in calls], json.loads(calls[0].arguments)) == ("Checking.", ["add", "weather"],
                                                                                  {"a": 2, "b": 3})
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert find_tool_calls(GRANITE.removeprefix("Checking."), NAMES, "granite")[0] is None


# ---- the glm45 format ---------------------------------------------------------------------------
TYPED_WEATHER = {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}}}}
GLM_TOOLS = offered([TYPED_WEATHER, {"name": "add", "parameters": {"type": "object"}}, {"name": "now"}])
GLM45 = ('Let me look.<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n'
         '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key><arg_value>"c"</arg_value>\n'
         '</tool_call>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>{"x": [1, 2]}</arg_value>\n'
         '<arg_key>b</arg_key>\n<arg_value>not json</arg_value>\n</tool_call><tool_call>now</tool_call>')


def test_glm45_calls_typed_by_the_functions_schemas():
    """A string-typed parameter keeps its text ("123"), any other is the JSON it holds (3, "c", an
    object), and text that is not JSON stays text; a call may take no arguments."""
    assert GLM_TOOLS["weather"] == {"city": "string", "days": "integer"} and GLM_TOOLS["now"] == {}
    content, calls = parse_glm45_calls(GLM45, GLM_TOOLS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "123", "days": 3, "units": "c"}), ("add", {"a": {"x": [1, 2]}, "b": "not json"}),
        ("now", {})]
    assert find_tool_calls(GLM45, GLM_TOOLS, "glm45")[1][0].id.startswith("call_")


# ---- the minimax_m2 format -----------------------------------------------------------------------
MINIMAX_TOOLS = offered([{"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "scale": {"type": "number"},
    "exact": {"type": "boolean"}, "tags": {"type": "array"}, "extra": {"type": ["object", "null"]}}}}, TYPED_WEATHER])
MINIMAX = ('Let me search.\n<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">\n42\n</parameter>\n'
           '<parameter name="limit">7</parameter>\n<parameter name="scale">2.0</parameter>\n'
           '<parameter name="exact">True</parameter>\n<parameter name="tags">["a", "b"]</parameter>\n'
           '<parameter name="extra">{"k": 1}</parameter>\n<parameter name="note">[1]</parameter>\n</invoke>\n'
           "<invoke name='weather'>\n<parameter name=\"city\">Oslo</parameter>\n<parameter name=\"days\">three"
           '</parameter>\n</invoke>\n</minimax:tool_call>\n<minimax:tool_call><invoke name="search">'
           '<parameter name="scale">0.5</parameter><parameter name="limit">null</parameter></invoke>'
           '</minimax:tool_call>')


def test_minimax_calls_typed_as_minimax_reads_them():
    """Several invokes a block, several blocks: a string parameter, and one the schema does not
    type, keep their (stripped) text; an integer, number or boolean is converted (a whole number
    an integer, text that does not parse kept); an array or a type named otherwise is its JSON;
    `null` is null; a name may be quoted either way."""
    content, calls = parse_minimax_calls(MINIMAX, MINIMAX_TOOLS)
    assert content == "Let me search."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search", {"query": "42", "limit": 7, "scale": 2, "exact": True, "tags": ["a", "b"], "extra": {"k": 1},
                    "note": "[1]"}),
        ("weather", {"city": "Oslo", "days": "three"}), ("search", {"scale": 0.5, "limit": None})]
    assert find_tool_calls(MINIMAX, MINIMAX_TOOLS, "minimax_m2")[1][0].id.startswith("call_")


@pytest.mark.parametrize("value, kind, expected", [("inf", "number", "inf"), ("1e400", "number", "1e400"),
                                                   ("nan", "float", "nan"), ("3.0", "integer", "3.0"),
                                                   ("0", "bool", False), ("NULL", "string", None),
                                                   ("x", "object", "x")])
def test_minimax_values_that_json_cannot_hold_stay_text(value, kind, expected):
    tools = offered([{"name": "f", "parameters": {"properties": {"v": {"type": kind}}}}])
    text = f'<minimax:tool_call><invoke name="f"><parameter name="v">{value}</parameter></invoke></minimax:tool_call>'
    assert json.loads(parse_minimax_calls(text, tools)[1][0].arguments) == {"v": expected}


# ---- the qwen3_coder format ----------------------------------------------------------------------
QWEN3_CODER = ("I'll write it.\n<tool_call>\n<function=search>\n<parameter=query>\n    def f():\n        return 1\n"
               "</parameter>\n<parameter=limit>\n7\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
               "</function>\n</tool_call>\n<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n"
               "</function>\n</tool_call>")


def test_qwen3_coder_calls_keep_a_values_own_blanks():
    """A value loses only the newline written on each side of it (the code's indentation stays),
    and is typed as minimax_m2's are; one call a `<tool_call>` block, after the content."""
    content, calls = parse_qwen3_coder_calls(QWEN3_CODER, MINIMAX_TOOLS)
    assert content == "I'll write it."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search", {"query": "    def f():\n        return 1", "limit": 7, "tags": ["a"]}),
        ("weather", {"city": "Oslo"})]
    assert find_tool_calls(QWEN3_CODER, MINIMAX_TOOLS, "qwen3_coder")[1][1].name == "weather"


def test_seed_oss_calls_are_qwen3_coders_in_its_own_tags():
    seed = QWEN3_CODER.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")
    ours, theirs = find_tool_calls(seed, MINIMAX_TOOLS, "seed_oss"), parse_qwen3_coder_calls(QWEN3_CODER, MINIMAX_TOOLS)
    assert ours[0] == theirs[0] == "I'll write it."
    assert [(c.name, c.arguments) for c in ours[1]] == [(c.name, c.arguments) for c in theirs[1]]
    assert find_tool_calls(QWEN3_CODER, MINIMAX_TOOLS, "seed_oss") is None  # Qwen3-Coder's tags are not its


# ---- text that is not calls in the typed formats ----------------------------------------------------
TYPED_NOT_CALLS = {
    "glm45": ["no calls here", "<tool_call>nope\n</tool_call>",
              "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value>",
              "<tool_call>add\nstray<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
              "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value>stray</tool_call>",
              "<tool_call>add\n<arg_key>a</arg_key></tool_call>", "<tool_call>now</tool_call> and more words"],
    "minimax_m2": ["no calls", "<minimax:tool_call></minimax:tool_call>",
                   '<minimax:tool_call><invoke name="add"></invoke>',
                   '<minimax:tool_call><invoke name="nope"></invoke></minimax:tool_call>',
                   '<minimax:tool_call>x<invoke name="add"></invoke></minimax:tool_call>',
                   '<minimax:tool_call><invoke name="add">x</invoke></minimax:tool_call>',
                   '<minimax:tool_call><invoke name="add"><parameter name="a">1</parameter></minimax:tool_call>',
                   '<minimax:tool_call><invoke name="add"></invoke></minimax:tool_call> and more'],
    "qwen3_coder": ["<tool_call>\n</tool_call>", "<tool_call><function=nope></function></tool_call>",
                    "<tool_call><function=add><parameter=a>1</function></tool_call>",
                    "<tool_call><function=add>x</function></tool_call>",
                    '<tool_call>{"name": "add", "arguments": {}}</tool_call>', "<tool_call><function=add></function>"],
    "seed_oss": ["<seed:tool_call><function=nope></function></seed:tool_call>",
                 "<seed:tool_call><function=add></function></seed:tool_call> more"],
}


@pytest.mark.parametrize("parser, text", [(parser, text) for parser, texts in TYPED_NOT_CALLS.items()
                                          for text in texts])
def test_text_that_is_not_only_calls_after_the_tag_is_content(parser, text):
    assert find_tool_calls(text, GLM_TOOLS, parser) is None


# ---- the tagged formats, streamed ---------------------------------------------------------------
PIECES = {
    "hermes": st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "\n", " ", "hi ", "{", "}",
                                        '{"name": "add", "arguments": {"a": 1}}', '"x"', "<", ">"]), max_size=12),
    "mistral": st.lists(st.sampled_from(["[TOOL_CALLS]", "[TOOL", "_CALLS]", "[ARGS]", "[CALL_ID]", "abc", "add",
                                         '{"a": 1}', '[{"name": "add", "arguments": {"b": 2}}]', " ", "hi ", "[", "]",
                                         "{", "}"]), max_size=12),
    "glm45": st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "add\n", "now",
                                       "<arg_key>a</arg_key>", "<arg_value>1</arg_value>", "<arg_value>", " ", "hi ",
                                       "\n"]), max_size=12),
    "granite": st.lists(st.sampled_from(["<|tool_call|>", "<|tool", "_call|>", '{"name": "add", "arguments": {}}',
                                         '[{"name": "add", "arguments": {"b": 2}}]', " ", "hi ", "[", "]", ",",
                                         "<|"]), max_size=12),
    "minimax_m2": st.lists(st.sampled_from(["<minimax:tool_call>", "</minimax:tool_call>", "<minimax:", "tool_call>",
                                            '<invoke name="add">', "</invoke>", '<parameter name="a">1</parameter>',
                                            "<parameter", " ", "hi ", "\n"]), max_size=12),
    "qwen3_coder": st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "<function=add>",
                                             "</function>", "<parameter=a>\n1\n</parameter>", "<parameter", " ",
                                             "hi ", "\n"]), max_size=12),
    "seed_oss": st.lists(st.sampled_from(["<seed:tool_call>", "</seed:tool_call>", "<seed:", "tool_call>",
                                          "<function=add>", "</function>", "<parameter=a>\n1\n</parameter>", " ", "hi ",
                                          "\n"]), max_size=12),
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), cut=st.integers(min_value=1, max_value=7), reason=st.sampled_from(["stop", "length"]))
@pytest.mark.parametrize("parser", ["hermes", "mistral", "granite", "glm45", "minimax_m2", "qwen3_coder", "seed_oss"])
def test_a_tagged_stream_cut_anywhere_ends_as_the_whole_text_is_read(parser, data, cut, reason):
    """Streamed in pieces of any size, the content sent and the calls found are the whole
    output's: what find_tool_calls reads from it (content alongside the calls), or all of it."""
    text = "".join(data.draw(PIECES[parser]))
    chunks = [text[i:i + cut] for i in range(0, len(text), cut)] or [""]
    stream, content, calls, last = StreamedCalls(NAMES, parser), "", None, None
    for i, chunk in enumerate(chunks):
        sent = stream.feed(chunk, reason if i == len(chunks) - 1 else None)
        if sent is not None:
            content, calls, last = content + sent[0], sent[1], sent[2]
    whole = find_tool_calls(text, NAMES, parser) if reason == "stop" else None
    if whole is None:
        assert (content, calls, last) == (text, None, reason)
    else:
        assert content.strip() == (whole[0] or "") and last == "tool_calls"
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]
