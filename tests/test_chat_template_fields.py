"""vLLM's chat template fields on the chat route: chat_template_kwargs (names the template reads, such as
DeepSeek-V3.1's `thinking`), add_generation_prompt and continue_final_message (an assistant's start to go on from)."""

import httpx2 as httpx
import pytest

from mla_deploy.errors import InputError
from mla_deploy.runtime.chat import ChatTemplate

THINKING = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<User>{{ m.content }}"
            "{% else %}<Assistant>{{ m.content }}<end>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<Assistant>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}")
TRIMMING = "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}"
ASK = [{"role": "user", "content": "Write a loop"}]


def test_template_variables_and_an_open_final_message():
    template = ChatTemplate(THINKING, "<s>")
    assert template.render(ASK, variables={"thinking": True}) == "<s><User>Write a loop<Assistant><think>"
    assert template.render(ASK) == "<s><User>Write a loop<Assistant></think>"
    start = ASK + [{"role": "assistant", "content": "for i in "}]
    assert template.render(start, False, continue_final_message=True) == "<s><User>Write a loop<Assistant>for i in "
    assert template.render(start, False) == "<s><User>Write a loop<Assistant>for i in <end>"
    trimmed = ChatTemplate(TRIMMING).render(start, False, continue_final_message=True)
    assert trimmed == "[user] Write a loop\n[assistant] for i in"  # the template trims: its text is what goes on
    with pytest.raises(InputError, match="no generation prompt"):
        template.render(start, True, continue_final_message=True)
    shouting = ChatTemplate("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(InputError, match="does not write the last message's content"):
        shouting.render(start, False, continue_final_message=True)


openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
from serving import MODEL, running_server  # noqa: E402


@pytest.fixture(scope="module")
def server(demo_export_dir):
    with running_server(demo_export_dir, max_batch=4, chat_template=THINKING) as s:
        yield s


def test_a_continued_message_generates_what_its_text_as_a_completion_does(server):
    base, service = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    start = ASK + [{"role": "assistant", "content": "for path in "}]
    r = client.chat.completions.create(model=MODEL, messages=start, max_tokens=12, temperature=0,
                                       extra_body={"continue_final_message": True})
    text = service.chat_template.render(start, False, continue_final_message=True)
    ids = service.tokenizer.encode(text, add_special_tokens=False)
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == same.choices[0].text


def test_template_kwargs_reach_the_template(server):
    base, service = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    def prompt_tokens(**extra):
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=extra
                                              ).usage.prompt_tokens

    thinking = service.chat_template.prompt_ids(ASK, service.tokenizer, variables={"thinking": True})
    plain = service.chat_template.prompt_ids(ASK, service.tokenizer)
    assert thinking != plain
    assert prompt_tokens(chat_template_kwargs={"thinking": True}) == len(thinking)
    assert prompt_tokens() == prompt_tokens(chat_template_kwargs={"thinking": False}) == len(plain)
    assert prompt_tokens(add_generation_prompt=False) == len(
        service.chat_template.prompt_ids(ASK, service.tokenizer, False))


@pytest.mark.parametrize("body, param, says", [
    ({"chat_template_kwargs": ["thinking"]}, "chat_template_kwargs", "expected an object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "kwargs.messages: the template already"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "send tools as a field"),
    ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs", "raise_exception: the template"),
    ({"chat_template_kwargs": {"namespace": 1}}, "chat_template_kwargs", "(the server's or Jinja's)"),
    ({"chat_template_kwargs": {"self": 1, "names": 2}}, None, None),  # any other name reaches the template
    ({"continue_final_message": True, "messages": ASK + [{"role": "assistant", "content": " "}]},
     "continue_final_message", "content is empty"),
    ({"continue_final_message": True}, "continue_final_message", "the last message is the user's"),
    ({"continue_final_message": True, "add_generation_prompt": True,
      "messages": ASK + [{"role": "assistant", "content": "x"}]}, "add_generation_prompt", "leave it out"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt", "true or false"),
])
def test_template_fields_are_served_or_a_400_naming_them(server, body, param, says):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body})
    if param is None:
        assert r.status_code == 200, r.text
        return
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], error


def test_template_fields_are_chat_fields(server):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                        "chat_template_kwargs": {"thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
