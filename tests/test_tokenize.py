"""vLLM's /tokenize and /detokenize: the ids the generation routes would run, counted against the model's length."""

import httpx2 as httpx
import pytest

openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
from serving import MODEL, running_server  # noqa: E402


@pytest.fixture(scope="module")
def server(demo_export_dir):
    with running_server(demo_export_dir, max_batch=2, api_key="k") as s:
        yield s


def post(server, route, **body):
    return httpx.post(server[0] + route, json={"model": MODEL, **body}, headers={"Authorization": "Bearer k"})


def test_tokenize_gives_the_ids_the_generation_routes_run(server):
    base, service = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    text = "def read(path):\n    return open(path).read()"
    r = post(server, "/tokenize", prompt=text, return_token_strs=True).json()
    assert r["tokens"] == service.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == service.engine.model.max_seq_len
    assert r["count"] == client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens
    assert len(r["token_strs"]) == r["count"] and "".join(r["token_strs"][1:]).replace("Ġ", " ").startswith("def")
    bare = post(server, "/tokenize", prompt=text, add_special_tokens=False).json()
    assert bare["tokens"] == r["tokens"][1:] and bare["token_strs"] is None  # the demo's tokenizer adds a BOS
    messages = [{"role": "user", "content": "Read a file"}, {"role": "assistant", "content": "def "}]
    chat = post(server, "/tokenize", messages=messages, continue_final_message=True).json()
    assert chat["count"] == client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"continue_final_message": True}).usage.prompt_tokens
    back = post(server, "/detokenize", tokens=r["tokens"]).json()
    assert back == {"prompt": text}
    headers = {"Authorization": "Bearer k"}  # model is optional, as vLLM's
    assert httpx.post(base + "/tokenize", json={"prompt": text}, headers=headers).json()["tokens"] == r["tokens"]
    assert httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}, headers=headers).json() == back


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "chat_template_kwargs": {}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": []}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [4096]}, 400, "tokens"),
])
def test_malformed_tokenize_requests_are_errors_naming_the_field(server, route, body, status, param):
    r = post(server, route, **body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert httpx.post(server[0] + route, json={"model": MODEL, "prompt": "x"}).status_code == 401  # the key
