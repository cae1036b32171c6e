"""serve --reasoning-parser deepseek_r1: a thinking model's reasoning apart from its answer, whole and streamed in any
pieces, beside tool calls, and through the openai client on the demo."""

import json

import pytest

from mla_deploy.serve.choices import ChatReply
from mla_deploy.serve.reasoning import ReasoningSplit
from mla_deploy.serve.tools import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, Tools, ToolReply

CASES = [  # reply text -> (reasoning_content, content)
    ("<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", ("\nFirst, 2 + 2.\n", "\n\nIt is 4.")),
    ("The template opened it.</think>Answer.", ("The template opened it.", "Answer.")),
    ("\n<think>x</think>y", ("x", "y")),
    ("</think>No reasoning.", ("", "No reasoning.")),
    ("Cut off while thinking </thi", ("Cut off while thinking </thi", None)),
    ("<thi", ("<thi", None)),
    ("Nested <think> stays text</think>done</think>", ("Nested <think> stays text", "done</think>")),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_reasoning_is_split_from_the_answer_the_same_in_any_pieces(text, expected):
    for size in (len(text), 1, 2, 3, 7):
        split, reasoning, content = ReasoningSplit(), "", ""
        for i in range(0, len(text), size):
            r, c = split.push(text[i:i + size])
            reasoning, content = reasoning + r, content + c
            assert "</think>" not in reasoning and not (content and split.content is None)
        r, c = split.finish()
        assert (split.reasoning, split.content) == expected
        assert (reasoning + r, content + c) == (expected[0], expected[1] or "")


def test_tool_calls_are_read_from_the_answer_after_the_reasoning():
    calls = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Oslo"}}{CALL_END}{CALLS_END}'
    text = f"<think>They want the weather.</think>Checking.{calls}"
    tools = Tools(({"type": "function", "function": {"name": "get_weather"}},), "auto")
    for size in (len(text), 1, 4):
        reply, sent = ChatReply(ReasoningSplit(), ToolReply(tools)), []
        for i in range(0, len(text), size):
            last = i + size >= len(text)
            sent.append(reply.push(text[i:i + size], "stop" if last else None))
        assert "".join(s[0] for s in sent) == "They want the weather." and "".join(s[1] for s in sent) == "Checking."
        assert [(d["function"]["name"], d["function"]["arguments"]) for s in sent for d in s[2]] == [
            ("get_weather", '{"city": "Oslo"}')] and sent[-1][3] == "tool_calls"
        reasoning, content, tool_calls = reply.message()
        assert (reasoning, content, tool_calls[0]["function"]["name"]) == ("They want the weather.", "Checking.",
                                                                           "get_weather")


def test_a_reply_still_thinking_has_no_content_and_no_calls():
    tools = Tools(({"type": "function", "function": {"name": "f"}},), "auto")
    reply = ChatReply(ReasoningSplit(), ToolReply(tools))
    assert reply.push("<think>Let me see", "length") == ("Let me see", "", [], "length")
    assert reply.message() == ("Let me see", None, None)


openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
from test_serve import MODEL, running_server  # noqa: E402


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from mla_deploy.export import export
    from mla_deploy.presets import DEMO_CHECKPOINT

    out = tmp_path_factory.mktemp("reasoning") / "demo"
    export(DEMO_CHECKPOINT, out)
    return out


def test_served_reasoning_content_streamed_or_not_and_never_under_a_grammar(demo):
    """The demo never closes a reasoning, so its whole reply is reasoning_content (content None), as vLLM's parser
    reads an R1 reply cut off while thinking; the same text a server without the parser sends as content."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Read a file"}], max_tokens=24, temperature=0)
    with running_server(demo, max_batch=2) as (base, _):
        plain = openai.OpenAI(base_url=base + "/v1", api_key="x").chat.completions.create(**ask).choices[0].message
    with running_server(demo, max_batch=2, reasoning_parser="deepseek_r1") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        message = client.chat.completions.create(**ask).choices[0].message
        assert (message.reasoning_content, message.content) == (plain.content, None) and plain.content
        chunks = list(client.chat.completions.create(**ask, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == plain.content
        assert not "".join(d.content or "" for d in deltas)
        shaped = client.chat.completions.create(**{**ask, "max_tokens": 80}, response_format={"type": "json_object"})
        if shaped.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(shaped.choices[0].message.content), dict)
        assert getattr(shaped.choices[0].message, "reasoning_content", None) is None
        text = client.completions.create(model=MODEL, prompt="def ", max_tokens=8, temperature=0).choices[0].text
        assert text  # completions are never split


def test_the_cli_offers_every_parser():
    from click.testing import CliRunner

    from mla_deploy.cli import main
    from mla_deploy.serve.reasoning import PARSERS

    help_text = CliRunner().invoke(main, ["serve", "--help"]).stdout
    assert "--reasoning-parser [" + "|".join(PARSERS) + "]" in help_text.replace("\n", " ")
