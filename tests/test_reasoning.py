"""serve --reasoning-parser deepseek_r1: a thinking model's reasoning apart from its answer, whole and streamed in any
pieces, beside tool calls, and through the openai client on the demo."""

import pytest

from mla_deploy.serve.choices import ChatReply
from mla_deploy.serve.reasoning import ReasoningSplit, reasoning_opened
from mla_deploy.serve.tools import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, Tools, tool_reply

CASES = [  # reply text -> (reasoning_content, content)
    ("<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", ("\nFirst, 2 + 2.\n", "\n\nIt is 4.")),
    ("The template opened it.</think>Answer.", ("The template opened it.", "Answer.")),
    ("\n<think>x</think>y", ("x", "y")),
    ("</think>No reasoning.", ("", "No reasoning.")),
    ("Cut off while thinking </thi", ("Cut off while thinking </thi", None)),
    ("<thi", ("<thi", None)),
    ("Nested <think> stays text</think>done</think>", ("Nested <think> stays text", "done</think>")),
    ("Nothing after it</think>", ("Nothing after it", None)),
]
UNOPENED = [  # the prompt closed or never opened a reasoning: only a reply opening one reasons
    ("A plain answer.", (None, "A plain answer.")),
    ("<think>Opened by the reply.</think>Answer.", ("Opened by the reply.", "Answer.")),
    ("<th", (None, "<th")),
    ("Not </think> a split", (None, "Not </think> a split")),
]


@pytest.mark.parametrize("opened, text, expected", [(True, *c) for c in CASES] + [(False, *c) for c in UNOPENED])
def test_reasoning_is_split_from_the_answer_the_same_in_any_pieces(opened, text, expected):
    for size in (len(text), 1, 2, 3, 7):
        split, reasoning, content = ReasoningSplit(opened), "", ""
        for i in range(0, len(text), size):
            r, c = split.push(text[i:i + size])
            reasoning, content = reasoning + r, content + c
            assert "</think>" not in reasoning and not (content and split.content is None)
        r, c = split.finish()
        assert (split.reasoning, split.content) == expected
        assert (reasoning + r, content + c) == (expected[0] or "", expected[1] or "")


def test_a_prompt_ending_inside_a_reasoning_opens_it():
    assert reasoning_opened("<User>2+2?<Assistant><think>\n")
    assert not reasoning_opened("<User>2+2?<Assistant></think>")  # V3.1 without thinking
    assert not reasoning_opened("<think>a</think><User>2+2?<Assistant>") and not reasoning_opened("no tags")


def test_tool_calls_are_read_from_the_answer_after_the_reasoning():
    calls = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Oslo"}}{CALL_END}{CALLS_END}'
    text = f"<think>They want the weather.</think>Checking.{calls}"
    tools = Tools(({"type": "function", "function": {"name": "get_weather"}},), "auto")
    for size in (len(text), 1, 4):
        reply, sent = ChatReply(ReasoningSplit(), tool_reply(tools)), []
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
    reply = ChatReply(ReasoningSplit(), tool_reply(tools))
    assert reply.push("<think>Let me see", "length") == ("Let me see", "", [], "length")
    assert reply.message() == ("Let me see", None, None)


openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
from serving import MODEL, running_server  # noqa: E402


THINKING = ("{{ bos_token }}{% for m in messages %}# {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}{% if thinking %}<think>\n{% else %}</think>{% endif %}{% endif %}")


def test_served_reasoning_content_streamed_or_not_and_never_under_a_grammar(demo_export_dir):
    """With thinking on, the template opens the reasoning and the demo never closes it: its whole reply is
    reasoning_content (content null), as vLLM's parser reads an R1 reply cut off while thinking; with thinking off
    (V3.1's switch) the reply is content. Either way the text a server without the parser sends as content."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Read a file"}], max_tokens=24, temperature=0)
    served = {}
    for parser in (None, "deepseek_r1"):
        with running_server(demo_export_dir, max_batch=2, chat_template=THINKING, reasoning_parser=parser) as (base, _):
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            for thinking in (True, False):
                kw = {**ask, "extra_body": {"chat_template_kwargs": {"thinking": thinking}}}
                whole = client.chat.completions.create(**kw).choices[0].message
                deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
                streamed = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                            "".join(d.content or "" for d in deltas))
                served[parser, thinking] = (getattr(whole, "reasoning_content", None), whole.content, streamed)
            shaped = client.chat.completions.create(**{**ask, "max_tokens": 80},
                                                    response_format={"type": "json_object"},
                                                    extra_body={"chat_template_kwargs": {"thinking": True}})
            assert getattr(shaped.choices[0].message, "reasoning_content", None) is None  # a grammar: no split
            served[parser, "completion"] = client.completions.create(model=MODEL, prompt="def ", max_tokens=8,
                                                                     temperature=0).choices[0].model_dump()
    text = served[None, True][1]
    assert text and served[None, True] == (None, text, ("", text))
    assert served["deepseek_r1", True] == (text, None, (text, ""))
    plain = served[None, False][1]
    assert served["deepseek_r1", False] == (None, plain, ("", plain)) == served[None, False]
    assert served["deepseek_r1", "completion"] == served[None, "completion"]  # completions are never split


def test_only_the_generation_prompt_or_a_continued_message_opens_a_reasoning(demo_export_dir):
    """A user quoting `<think>` opens nothing: the reply is content; an assistant's start that opened one and is
    continued is reasoning."""
    quoting = [{"role": "user", "content": "What does a <think> tag do?"}]
    started = quoting + [{"role": "assistant", "content": "<think>Tags are"}]
    with running_server(demo_export_dir, max_batch=2, chat_template=THINKING, reasoning_parser="deepseek_r1") as (
            base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        for extra in ({"chat_template_kwargs": {"thinking": False}}, {"add_generation_prompt": False}):
            message = client.chat.completions.create(model=MODEL, messages=quoting, max_tokens=8, temperature=0,
                                                     extra_body=extra).choices[0].message
            assert message.content and getattr(message, "reasoning_content", None) is None, extra
        message = client.chat.completions.create(model=MODEL, messages=started, max_tokens=8, temperature=0,
                                                 extra_body={"continue_final_message": True}).choices[0].message
        assert message.content is None and message.reasoning_content


def test_the_cli_offers_every_parser():
    from click.testing import CliRunner

    from mla_deploy.cli import main
    from mla_deploy.serve.reasoning import PARSERS

    help_text = CliRunner().invoke(main, ["serve", "--help"]).stdout
    assert "--reasoning-parser [" + "|".join(PARSERS) + "]" in help_text.replace("\n", " ")


def test_usage_counts_the_reasoning_tokens(demo_export_dir):
    """completion_tokens_details.reasoning_tokens, as DeepSeek's API counts them: every token of a reply still
    thinking, none of an answer, streamed or not; absent without the parser."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Read a file"}], max_tokens=12, temperature=0)
    for parser in (None, "deepseek_r1"):
        with running_server(demo_export_dir, max_batch=2, chat_template=THINKING, reasoning_parser=parser) as (
                base, _):
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            for thinking in (True, False):
                kw = {**ask, "n": 2, "extra_body": {"chat_template_kwargs": {"thinking": thinking}}}
                whole = client.chat.completions.create(**kw).usage
                streamed = [c.usage for c in client.chat.completions.create(
                    **kw, stream=True, stream_options={"include_usage": True}) if c.usage][0]
                shaped = client.chat.completions.create(**{**kw, "n": 1}, response_format={"type": "json_object"})
                assert (shaped.usage.completion_tokens_details is None) == (parser is None)
                assert parser is None or shaped.usage.completion_tokens_details.reasoning_tokens == 0  # not split
                for use in (whole, streamed):
                    details = use.completion_tokens_details
                    if parser is None:
                        assert details is None
                    else:
                        assert details.reasoning_tokens == (use.completion_tokens if thinking else 0), use
                        assert use.completion_tokens == 24  # two choices of 12, neither ended early


def test_reasoning_tokens_include_the_closing_tag():
    from mla_deploy.runtime.scheduler import TokenEvent
    from mla_deploy.serve.choices import Out

    pieces = ["<think>", "Hmm", " ok", "</think>", "Hi", " there"]
    for opened, expected in ((False, 4), (True, 4)):
        reply, outs, offset = ChatReply(ReasoningSplit(opened), None, True), [], 0
        for i, piece in enumerate(pieces):
            outs.append(Out(TokenEvent(i, None, None), piece, offset))
            offset += len(piece)
            reply.push(piece, "stop" if i == len(pieces) - 1 else None)
        assert reply.reasoning_tokens(outs) == expected and reply.message()[:2] == ("Hmm ok", "Hi there")
    closed_at_once = ChatReply(ReasoningSplit(True), None, True)
    closed_at_once.push("</think>Hi", "stop")
    assert closed_at_once.reasoning_tokens([Out(TokenEvent(0, None, None), "</think>", 0),
                                            Out(TokenEvent(1, None, None), "Hi", 8)]) == 1
    assert ChatReply(None, None, True).reasoning_tokens([]) == 0  # a parser, but a reply under a grammar
    assert ChatReply(None, None, False).reasoning_tokens([]) is None  # no parser: no count
