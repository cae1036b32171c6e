"""A chat over one cache row (runtime.conversation, `mla-deploy chat`): each turn prefills only what is new, and
replies as the whole conversation prefilled from scratch would."""

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from mla_deploy.cli import main
from mla_deploy.errors import InputError
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime.conversation import Conversation

GREEDY = SamplingParams()
ASKS = ["read a file and count its lines", "now sort the lines\nand print them"]


@pytest.fixture(scope="module")
def model(demo_export_dir):
    return ExportedModel(demo_export_dir)


def alone(model, conversation, messages, n):
    """The reply the whole conversation's prompt gets prefilled from scratch, the stop token left out."""
    prompt = conversation.template.prompt_ids(messages, conversation.tokenizer)
    tokens = Generator(model, GREEDY).generate([prompt], n).token_ids[0]
    return prompt, [t for t in tokens if t not in model.stop_token_ids]


def test_each_turn_prefills_only_its_new_tokens_and_replies_as_a_fresh_prompt(model):
    chat = Conversation(model, GREEDY, max_new_tokens=12, system="You write Python.")
    before = None  # the turn before: its prompt's and reply's lengths
    for ask in ASKS:
        messages = chat.messages + [{"role": "user", "content": ask}]
        prompt, expected = alone(model, chat, messages, 12)
        pieces = []
        turn = chat.say(ask, on_text=pieces.append)
        assert turn.token_ids == expected
        assert "".join(pieces) == turn.text == chat.tokenizer.decode(expected)
        assert turn.prompt_tokens == len(prompt)
        if before is None:
            assert turn.cached_tokens == 0
        else:  # the turn before's prompt and reply were in the row: only the new message's tokens are prefilled
            assert turn.cached_tokens >= sum(before) - 1
            assert turn.prompt_tokens - turn.cached_tokens < len(prompt) - before[0]
        before = (len(prompt), len(turn.token_ids))
        assert chat.messages[-2:] == [{"role": "user", "content": ask}, {"role": "assistant", "content": turn.text}]
    assert chat.messages[0] == {"role": "system", "content": "You write Python."}


def test_a_sampled_reply_is_held_as_generated_not_tokenized_again(model):
    """A sampled reply's tokens may not be its text's canonical tokenization (two space tokens where one would
    do): the next turn's prompt holds them as generated, so only the new message is prefilled, as after a greedy
    reply."""
    chat = Conversation(model, SamplingParams(temperature=1.0, seed=0), max_new_tokens=120, system="You write Python.")
    turns = [chat.say(ask) for ask in ("Read a file.", "Count its lines.", "Now sort them.")]
    recoded = 0
    for before, turn in zip(turns, turns[1:]):
        recoded += chat.tokenizer.encode(before.text, add_special_tokens=False) != before.token_ids
        assert turn.cached_tokens >= before.prompt_tokens + len(before.token_ids) - 1, (before, turn)
    assert recoded  # a reply whose text tokenizes otherwise was among them: the case this covers
    messages = chat.messages + [{"role": "user", "content": "Thanks."}]  # the same text, the replies' ids kept
    ids = chat._prompt(messages)
    assert chat.tokenizer.decode(ids) == chat.tokenizer.decode(chat.template.prompt_ids(messages, chat.tokenizer))
    for turn in turns:
        assert any(ids[i:i + len(turn.token_ids)] == turn.token_ids for i in range(len(ids)))


def test_a_reply_whose_text_stands_earlier_is_held_in_its_own_place(model):
    """A one-token reply ("the") whose text the rendering holds earlier too (in the user's words): its ids go where
    the template wrote the reply, the user's text is tokenized as in the turn before, and the next turn starts from
    the whole cached conversation."""
    chat = Conversation(model, GREEDY, max_new_tokens=1)
    ask = ("the quick brown fox jumps over the lazy dog and then it is in on at to of for with as by that this was "
           "were be are not but from or have had an they which you one all their there when can would about")
    first = chat.say(ask)
    prompt = chat.template.prompt_ids(chat.messages[:1], chat.tokenizer)
    assert first.text and first.text in ask  # the case this covers
    ids = chat._prompt(chat.messages + [{"role": "user", "content": "ok"}])
    assert ids[:len(prompt) + 1] == prompt + first.token_ids
    second = chat.say("ok")
    assert second.cached_tokens >= len(prompt) + len(first.token_ids) - 1 and second.prompt_tokens == len(ids)


def test_reset_starts_again_from_the_system_message(model):
    chat = Conversation(model, GREEDY, max_new_tokens=8)
    first = chat.say(ASKS[0])
    chat.say(ASKS[1])
    chat.reset()
    assert chat.messages == []
    again = chat.say(ASKS[0])
    assert again.token_ids == first.token_ids
    assert again.cached_tokens > 0  # the same prompt's slots are still in the row


def test_an_interrupted_reply_ends_where_it_is_and_stays_in_the_conversation(model):
    chat = Conversation(model, GREEDY, max_new_tokens=64)
    pieces = []
    turn = chat.say(ASKS[0], pieces.append, interrupted=lambda: len(pieces) >= 3)
    assert turn.finish_reason == "cancelled"
    assert 1 <= len(turn.token_ids) < 64
    assert chat.messages[-1] == {"role": "assistant", "content": turn.text}
    _, expected = alone(model, chat, chat.messages[:1], len(turn.token_ids))
    assert turn.token_ids == expected  # the reply's start, as an uninterrupted one


def test_a_reply_stops_at_the_context_and_a_message_past_it_is_refused(model):
    chat = Conversation(model, GREEDY, max_new_tokens=512)
    long = " ".join(["lines"] * 2000)
    with pytest.raises(InputError, match=r"the conversation \d+ tokens, and the model's context is 1024: no room"):
        chat.say(long)
    assert chat.messages == []  # the refused message is not kept
    near = " ".join(["x"] * 1000)
    prompt = chat.template.prompt_ids([{"role": "user", "content": near}], chat.tokenizer)
    assert len(prompt) < model.max_seq_len
    turn = chat.say(near)
    assert len(turn.token_ids) + (turn.finish_reason == "stop") <= model.max_seq_len - len(prompt)


def test_the_first_token_is_out_before_the_first_decode_step(model):
    chat = Conversation(model, GREEDY, max_new_tokens=6)
    decode_steps = []
    turn = chat.say(ASKS[0], lambda text: decode_steps.append(chat.scheduler.stats.decode_steps))
    assert decode_steps[0] == 0 and len(turn.token_ids) >= 2
    assert turn.first_token_ms > 0 and turn.decode_tokens_per_s > 0


def test_a_failing_reader_frees_the_row_for_the_next_turn(model):
    chat = Conversation(model, GREEDY, max_new_tokens=300)
    pieces = []

    def closed_pipe(text):
        pieces.append(text)
        if len(pieces) == 2:
            raise BrokenPipeError

    with pytest.raises(BrokenPipeError):
        chat.say(ASKS[0], closed_pipe)
    assert not chat.scheduler.has_work() and chat.messages == []
    generated = chat.scheduler.stats.generated_tokens
    turn = chat.say(ASKS[1])
    assert turn.token_ids == alone(model, chat, chat.messages[:-1], 300)[1]
    assert chat.scheduler.stats.generated_tokens - generated == len(turn.token_ids) + (turn.finish_reason == "stop")


def test_the_oldest_turns_make_room_for_the_next_reply(model):
    chat = Conversation(model, GREEDY, max_new_tokens=200, system="You write Python.")
    asks = [" ".join([f"step {i}"] * 120) for i in range(4)]  # ~250 tokens each
    turns = [chat.say(ask) for ask in asks]
    assert turns[0].dropped_turns == 0 and sum(t.dropped_turns for t in turns) >= 1
    users = [m["content"] for m in chat.messages if m["role"] == "user"]
    assert asks[0] not in users and users[-1] == asks[-1] and chat.messages[0]["role"] == "system"
    prompt = chat.template.prompt_ids(chat.messages[:-1], chat.tokenizer)
    assert len(prompt) + 200 <= model.max_seq_len  # the last reply had its whole budget
    _, expected = alone(model, chat, chat.messages[:-1], 200)
    assert turns[-1].token_ids == expected and turns[-1].prompt_tokens == len(prompt)


def test_an_export_without_a_chat_template_or_tokenizer_is_refused_by_name(demo_export_dir, tmp_path):
    copy = tmp_path / "no-template"
    shutil.copytree(demo_export_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="no chat template .* give one"):
        Conversation(ExportedModel(copy))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"] = []  # an export of a checkpoint that came without one
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "tokenizer.json").unlink()
    with pytest.raises(InputError, match="no tokenizer"):
        Conversation(ExportedModel(copy))


def test_the_chat_command_streams_replies_and_says_what_came_from_the_cache(demo_export_dir, model):
    typed = (f"{ASKS[0]}\n{ASKS[1].replace(chr(10), chr(92) + chr(10))}\n/reset\n\n/nonsense\n/help\n/reset now\n"
             f"caf\xe9 not UTF-8\n{ASKS[0]}\n/bye\nnever read\n").encode("latin-1")
    result = CliRunner().invoke(main, ["chat", str(demo_export_dir), "--temperature", "0", "--repetition-penalty",
                                       "1", "-n", "10", "--speculative", "off"], input=typed)
    assert result.exit_code == 0, result.output
    chat = Conversation(model, GREEDY, max_new_tokens=10)
    replies = [chat.say(ASKS[0]).text, chat.say(ASKS[1]).text]
    assert result.stdout == f"{replies[0]}\n{replies[1]}\n{replies[0]}\n"
    cached = [int(n) for n in re.findall(r"(\d+) from the cache", result.stderr)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0 and len(cached) == 3
    assert "[the conversation starts again]" in result.stderr
    assert "[unknown command /nonsense: /help lists them; //nonsense sends it as a message]" in result.stderr
    assert "/reset  start" in result.stderr and "//text  send a message that starts with a slash" in result.stderr
    assert "[/reset takes no argument: /help lists the commands]" in result.stderr and "/quit" in result.stderr
    assert "[the line is not UTF-8 text: dropped]" in result.stderr


def test_a_message_may_start_with_a_slash_and_the_end_of_input_ends_an_unfinished_one(demo_export_dir, model):
    """"//tmp" sends "/tmp" (one word starting with a slash is otherwise a command); the end of the input within a
    message (its last line ending in a backslash) ends the chat without
    sending it, as Ctrl-D ends it anywhere."""
    typed = "//tmp\n  //reset now\nunfinished \\\n".encode()
    result = CliRunner().invoke(main, ["chat", str(demo_export_dir), "--temperature", "0", "--repetition-penalty",
                                       "1", "-n", "8", "--speculative", "off"], input=typed)
    assert result.exit_code == 0, result.output
    chat = Conversation(model, GREEDY, max_new_tokens=8)
    replies = [chat.say("/tmp").text, chat.say("  /reset now").text]
    assert result.stdout == f"{replies[0]}\n{replies[1]}\n"
    assert len(re.findall(r"from the cache", result.stderr)) == 2
    assert "[the unfinished message (its last line ended in a backslash) is not sent]" in result.stderr


def test_the_chat_command_refuses_bad_sampling_before_loading(tmp_path):
    result = CliRunner().invoke(main, ["chat", str(tmp_path / "not-loaded"), "--temperature", "inf"])
    assert result.exit_code != 0 and "temperature" in result.stderr and "not-loaded" not in result.stderr


def test_the_chat_command_says_why_it_cannot_start(tmp_path):
    result = CliRunner().invoke(main, ["chat", str(tmp_path / "missing")])
    assert result.exit_code != 0
    assert "missing" in result.stderr and "Traceback" not in result.output
    staged = tmp_path / "staged"
    assert CliRunner().invoke(main, ["export", "-o", str(staged), "--stages", "2", "--no-verify"]).exit_code == 0
    result = CliRunner().invoke(main, ["chat", str(staged)], input="hello\n")
    assert result.exit_code == 2 and "a staged export (export --stages N) chats through" in result.stderr


def test_a_numpy_reply_length_is_a_number(model):
    import numpy as np

    turn = Conversation(model, GREEDY, max_new_tokens=np.int64(3)).say("Read a file.")
    assert 1 <= len(turn.token_ids) <= 3
