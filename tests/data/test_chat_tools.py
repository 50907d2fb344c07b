"""Real datasets' chat records (issue 40.17): OpenAI-style content parts, tool-call turns (``content: null``
beside ``tool_calls``) and ``tool`` results rendered through a tool-aware chat template (Qwen3's tool
rendering), the loss mask on assistant text and tool calls only; a record with both ``conversations`` and
``messages`` refused."""

from __future__ import annotations

import json

import pytest
from test_data_chat import supervised_runs

from dflash_flow.data.chat import encode_chat, parse_conversation
from dflash_flow.data.records import read_records
from dflash_flow.data.reports import ReadOptions

# ChatML with tool calls and tool responses rendered as Qwen3's released template renders them.
TOOLS_TEMPLATE = """{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "Be brief."}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "18C and sunny"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is 18C."}]},
]


@pytest.fixture(scope="module")
def tools_tokenizer(make_tokenizer):
    return make_tokenizer(TOOLS_TEMPLATE)


def test_content_parts_and_tool_calls_are_parsed_not_refused():
    msgs, kind, why = parse_conversation({"messages": TOOL_CHAT})
    assert kind == "" and why == "", why
    assert msgs[0]["content"] == "Weather in Paris?\nBe brief."  # text parts joined as vLLM joins them
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"] == [CALL]
    assert msgs[2] == {"role": "tool", "content": "18C and sunny"} and msgs[3]["content"] == "It is 18C."


def test_tool_calls_are_supervised_and_tool_results_are_not(tools_tokenizer):
    msgs, _, _ = parse_conversation({"messages": TOOL_CHAT})
    enc = encode_chat(tools_tokenizer, msgs)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in enc.text
    runs = supervised_runs(tools_tokenizer, enc)
    assert runs[0] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    assert runs[1].endswith("It is 18C.<|im_end|>\n") and len(runs) == 2
    unsup = tools_tokenizer.decode(enc.input_ids[enc.loss_mask == 0].tolist())
    assert "18C and sunny" in unsup and "Weather in Paris?\nBe brief." in unsup


def test_text_and_tool_calls_in_one_turn_are_supervised_together(tools_tokenizer):
    msgs, _, _ = parse_conversation({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "18C."}]})
    runs = supervised_runs(tools_tokenizer, encode_chat(tools_tokenizer, msgs))
    assert runs[0] == 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'


def test_through_the_reader_bad_parts_and_both_keys_are_counted_with_their_reason(tools_tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    records = [
        {"messages": TOOL_CHAT},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                      {"role": "assistant", "content": "A cat."}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
         "conversations": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tf = read_records(path, tokenizer=tools_tokenizer, kind="chat",
                      options=ReadOptions(cache_dir=None, on_bad_record="skip", template_kwargs={"enable_thinking": False}))
    rep = tf.report
    assert rep.records == 3 and rep.bad == 2
    assert rep.bad_by_reason == {"missing_field": 1, "conflicting_fields": 1}
    text = rep.summary()
    assert "chat.jsonl:2" in text and "'image_url'" in text
    assert "chat.jsonl:3" in text and "both 'conversations' and 'messages'" in text


def test_regeneration_refuses_a_tool_conversation_naming_the_turn():
    from dflash_flow.data.chat import regeneration_plan

    with pytest.raises(ValueError, match="turn 1 calls tools: regeneration cannot replay tool calls"):
        regeneration_plan({"messages": TOOL_CHAT})
