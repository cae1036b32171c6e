"""Token healing (runtime.healing): a prompt ending part-way through a token is fed without it, and the first
generated token must start with its text; what run streams and returns is the text after the prompt either way."""

import numpy as np
import pytest

from mla_deploy.errors import InputError
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime.complete import complete
from mla_deploy.runtime.healing import heal
from mla_deploy.runtime.text import Tokenizer


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from mla_deploy.export import ExportOptions, export

    out = tmp_path_factory.mktemp("healing") / "export"
    export(DEMO_CHECKPOINT, out, ExportOptions(draft=False))
    return ExportedModel(out)


@pytest.fixture(scope="module")
def tokenizer(demo):
    return Tokenizer(demo.directory / "tokenizer.json")


def test_a_trailing_space_is_healed_into_the_words_that_start_with_one(tokenizer):
    ids = tokenizer.encode("def ")
    healing = heal(tokenizer, ids, tokenizer.vocab_size)
    assert healing.prompt_ids == ids[:-1] and healing.removed == ids[-1] and healing.text == " "
    allowed = set(np.flatnonzero(healing.allowed))
    word = tokenizer.encode("def read")[-1]  # " read": one token, space included
    assert word in allowed and ids[-1] in allowed  # the lone space itself stays possible
    assert all(tokenizer.token_bytes(t).startswith(b" ") for t in allowed)
    # every token that starts with a space, found independently of the bisection
    assert allowed == {t for t in range(tokenizer.vocab_size)
                       if t not in tokenizer.special_ids and tokenizer.token_bytes(t).startswith(b" ")}


def test_prompts_healing_cannot_change_are_left_alone(tokenizer):
    v = tokenizer.vocab_size
    assert heal(tokenizer, tokenizer.encode("def")[-1:], v) is None  # one token: nothing left to condition on
    bos = tokenizer.encode("x")[0]
    assert bos in tokenizer.special_ids and heal(tokenizer, [5, bos], v) is None  # a special last token
    # a last token no longer token starts with
    longest = max((t for t in range(tokenizer.vocab_size) if t not in tokenizer.special_ids),
                  key=lambda t: (len(tokenizer.tokens_starting_with(tokenizer.token_bytes(t))) == 1,
                                 len(tokenizer.token_bytes(t))))
    assert len(tokenizer.tokens_starting_with(tokenizer.token_bytes(longest))) == 1
    assert heal(tokenizer, [bos, longest], tokenizer.vocab_size) is None


@pytest.mark.parametrize("prompt", ["def ", "import os\n\n\nclass St", "    return sel", "print(\""])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3)])
def test_the_healed_completion_continues_the_prompt_text(demo, tokenizer, prompt, sampling):
    pieces = []
    out = complete(demo, prompt, max_new_tokens=12, sampling=sampling, on_text=pieces.append)
    healing = heal(tokenizer, tokenizer.encode(prompt), tokenizer.vocab_size)
    assert out["prompt_ids"] == healing.prompt_ids and out["token_healing"]["text"] == healing.text
    assert healing.allowed[out["token_ids"][0]]
    # the healed prompt's text plus every generated token is the prompt plus the completion, streamed or returned
    whole = tokenizer.decode(healing.prompt_ids + out["token_ids"])
    assert whole == prompt + out["text"] == "".join(pieces)


def test_without_healing_the_prompt_is_fed_as_encoded(demo, tokenizer):
    out = complete(demo, "def ", max_new_tokens=8, sampling=SamplingParams(), token_healing=False)
    assert out["prompt_ids"] == tokenizer.encode("def ") and "token_healing" not in out
    assert out["text"] == tokenizer.decode(out["token_ids"])
    unhealable = complete(demo, "x = [1, 2", max_new_tokens=4, sampling=SamplingParams())  # no token extends " 2"
    assert unhealable["prompt_ids"] == tokenizer.encode("x = [1, 2") and "token_healing" not in unhealable


def test_the_first_token_mask_holds_against_the_model_s_choice(demo):
    prompts = [[1, 470], [1, 5, 6, 7]]
    plain = Generator(demo, SamplingParams()).generate(prompts, 6).token_ids
    mask = np.ones((2, demo.config.vocab_size), bool)
    mask[0, plain[0][0]] = False  # row 0 may not take its greedy choice; row 1 is free
    masked = Generator(demo, SamplingParams()).generate(prompts, 6, mask).token_ids
    assert masked[0][0] != plain[0][0] and masked[1] == plain[1]


@pytest.mark.parametrize("mask,message", [
    (np.ones((1, 4096), bool), r"shape \(2, 4096\)"),
    (np.ones((2, 4096), np.int8), "bool mask"),
    (np.zeros((2, 4096), bool), "row 0 allows no token"),
])
def test_a_bad_first_token_mask_is_refused_by_name(demo, mask, message):
    with pytest.raises(InputError, match=message):
        Generator(demo, SamplingParams()).generate([[1, 470], [1, 5]], 4, mask)


def test_the_mask_has_the_models_width_whatever_the_tokenizers(demo, tokenizer, tmp_path):
    """DeepSeek-V2's tokenizer holds 100,015 tokens and its model 102,400 logits: the first token's mask is the
    model's width, the tokens past the tokenizer's never allowed; a tokenizer with more tokens than the model has
    logits (an added one) has those left out. `run --prompt` heals on both."""
    import json
    import shutil

    ids = tokenizer.encode("def ")
    wider = heal(tokenizer, ids, tokenizer.vocab_size + 100)
    assert wider.allowed.shape == (tokenizer.vocab_size + 100,) and not wider.allowed[tokenizer.vocab_size:].any()
    assert (wider.allowed[:tokenizer.vocab_size] == heal(tokenizer, ids, tokenizer.vocab_size).allowed).all()
    d = tmp_path / "export"
    shutil.copytree(demo.directory, d)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": tokenizer.vocab_size, "content": " <extra>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False, "special": False})
    (d / "tokenizer.json").write_text(json.dumps(spec))
    assert Tokenizer(d / "tokenizer.json").vocab_size == demo.config.vocab_size + 1
    out = complete(ExportedModel(d), "def ", max_new_tokens=4)
    assert out["token_healing"]["text"] == " " and all(t < demo.config.vocab_size for t in out["token_ids"])
