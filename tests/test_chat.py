"""Chat prompts as transformers builds them: the template rendered with its helpers, then tokenized without the
tokenizer's own special tokens (the template writes the BOS), token for token what `apply_chat_template` gives."""

import pytest
from transformers import AutoTokenizer

from mla_deploy.errors import InputError
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime.chat import ChatTemplate
from mla_deploy.runtime.text import Tokenizer

# DeepSeek-V2-Chat's form: the BOS first, then role prefixes, the end-of-sequence token after each reply
DEEPSEEK_FORM = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# tools-style templates print objects with tojson and its options
TOJSON = ("{{ bos_token }}{% for m in messages %}{{ m | tojson(ensure_ascii=False, sort_keys=True) }}"
          "{{ m | tojson(indent=2) }}{{ m | tojson(separators=(',', ':'), ensure_ascii=True) }}{% endfor %}")
MESSAGES = [
    {"role": "system", "content": "Small helpers."},
    {"role": "user", "content": "Parse a path, ünïcode included"},
    {"role": "assistant", "content": "def parse(p):\n    return p.split('/')"},
    {"role": "user", "content": "And join it"},
]


@pytest.fixture(scope="module")
def tokenizers():
    return AutoTokenizer.from_pretrained(DEMO_CHECKPOINT), Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")


@pytest.mark.parametrize("template", [None, DEEPSEEK_FORM, TOJSON], ids=["demo", "deepseek-form", "tojson"])
def test_chat_prompt_ids_are_transformers_apply_chat_template(tokenizers, template):
    hf, ours = tokenizers
    chat = ChatTemplate.from_export(DEMO_CHECKPOINT) if template is None else ChatTemplate(template, "<|bos|>",
                                                                                           "<|eos|>")
    for messages in (MESSAGES[:1], MESSAGES[:2], MESSAGES):
        expected = hf.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                          tokenize=True)["input_ids"]
        ids = chat.prompt_ids(messages, ours)
        assert ids == expected
        assert ids.count(hf.bos_token_id) == 1  # the template's BOS, not a second from the tokenizer


def test_a_template_that_fails_or_renders_nothing_is_an_input_error(tokenizers):
    _, ours = tokenizers
    with pytest.raises(InputError, match="chat template failed on these messages: TypeError: "):
        ChatTemplate("{{ messages[0]['content'] | tojson(colour=1) }}").prompt_ids(MESSAGES, ours)
    with pytest.raises(InputError, match="chat template refused the messages: no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}").prompt_ids(MESSAGES, ours)
    with pytest.raises(InputError, match="the chat template renders these messages to no tokens"):
        ChatTemplate("{% for m in messages %}{% endfor %}").prompt_ids(MESSAGES, ours)


def test_generation_config_sampling_defaults_include_min_p(tmp_path):
    from mla_deploy.runtime.chat import GenerationDefaults

    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "min_p": 0.05, "eos_token_id": 2}')
    defaults = GenerationDefaults.from_export(tmp_path)
    assert (defaults.sampling.temperature, defaults.sampling.top_p, defaults.sampling.min_p) == (0.6, 0.95, 0.05)
    assert defaults.override(min_p=0.0).min_p == 0.0 and defaults.eos_token_ids == (2,)


@pytest.mark.parametrize("file, text, message", [
    ("generation_config.json", "[1]", "generation config must be a JSON object, not an array"),
    ("tokenizer_config.json", "[1]", "tokenizer config must be a JSON object, not an array"),
    ("tokenizer_config.json", '{"chat_template": 5}', "chat_template must be a Jinja template .* not 5"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "default"}]}', "chat_template must be a Jinja template"),
    ("tokenizer_config.json", '{"chat_template": "{{ x }}", "bos_token": 1}', "bos_token must be a string"),
])
def test_config_files_of_the_wrong_shape_are_named(tmp_path, file, text, message):
    """Valid JSON of the wrong shape: the file and the field named, where it was a Python error (a list has no .get,
    Jinja cannot compile 5)."""
    from mla_deploy.errors import ExportLoadError
    from mla_deploy.runtime.chat import GenerationDefaults

    (tmp_path / file).write_text(text)
    with pytest.raises(ExportLoadError, match=f"{file}: {message}"):
        GenerationDefaults.from_export(tmp_path)
        ChatTemplate.from_export(tmp_path)
