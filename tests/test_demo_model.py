"""The bundled demo model: an ordinary HF checkpoint, checked like any other, and its model card reproduced."""

import json
import re

import torch

from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.evaluate import evaluate
from mla_deploy.modeling import load_model, new_caches
from mla_deploy.runtime import ExportedModel, SamplingParams, Tokenizer
from mla_deploy.runtime.complete import complete
from mla_deploy.verify import verify_export

DEMO = DEMO_CHECKPOINT


def test_demo_is_a_small_ordinary_checkpoint():
    files = {p.name for p in DEMO.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= files
    assert sum(p.stat().st_size for p in DEMO.iterdir()) <= 30 * 2**20
    config = json.loads((DEMO / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["q_lora_rank"] and config["n_routed_experts"]
    assert config["first_k_dense_replace"] < config["num_hidden_layers"]  # at least one MoE layer


def test_demo_matches_transformers_through_the_hf_loader():
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(DEMO)
    ids = torch.randint(3, ours.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, torch.arange(64)[None].expand(2, -1), new_caches(ours.cfg, 2, 64), torch.zeros(2, dtype=torch.long),
               torch.ones(2, 64))
    assert (got - ref).abs().max().item() < 1e-4


def test_demo_export_verifies(demo_export_dir):
    report = verify_export(demo_export_dir, DEMO, steps=16)
    assert report.passed, report.lines


def test_model_card_heldout_loss_is_reproduced_by_eval(demo_export_dir):
    card = json.loads((DEMO / "eval.json").read_text())
    report = evaluate(demo_export_dir, DEMO / "heldout.txt", window=card["window"])
    assert report.difference < 1e-4  # export and torch source agree
    assert abs(report.export_loss - card["loss"]) < 1e-4  # the model card's number
    assert report.tokens == card["tokens"]


def test_demo_completes_python_like_text(demo_export_dir):
    out = complete(ExportedModel(demo_export_dir), prompt="import os\n\n\ndef ", max_new_tokens=48,
                   sampling=SamplingParams())  # greedy (the export's generation_config.json samples)
    text = out["text"]
    assert len(out["token_ids"]) == 48
    assert re.match(r"\w+\([\w, =*]*\):\n    \S", text), text  # a signature, then an indented body


def test_eval_loss_equals_torch_cross_entropy_computed_independently(demo_export_dir, tmp_path):
    """The export's and the source's losses share their loss code; torch's cross_entropy does not."""
    window = 64
    text = tmp_path / "text.txt"
    text.write_text((DEMO / "heldout.txt").read_text()[:4000])
    report = evaluate(demo_export_dir, text, window=window)
    ids = Tokenizer(DEMO / "tokenizer.json").encode(text.read_text())
    n = (len(ids) - 1) // window
    assert (len(ids) - 1) % window, "the text must end in a partial window, which eval scores too"
    rows = torch.tensor([ids[i * window: i * window + window + 1] for i in range(n)])  # [n, window + 1]
    tail = torch.tensor(ids[n * window:])[None]  # [1, the rest]
    model = load_model(DEMO)
    losses = []
    for w in (rows, tail):
        b, t = w.shape[0], w.shape[1] - 1
        logits = model(w[:, :-1], torch.arange(t)[None].expand(b, -1), new_caches(model.cfg, b, t),
                       torch.zeros(b, dtype=torch.long), torch.ones(b, t))  # [b, t, vocab]
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                        w[:, 1:].reshape(-1), reduction="sum"))
    loss = sum(losses) / (len(ids) - 1)
    assert report.tokens == len(ids) - 1  # every token after the first, the partial last window's too
    assert abs(report.torch_loss - loss.item()) < 1e-5
    assert abs(report.export_loss - loss.item()) < 1e-4


def test_scoring_takes_its_log_normalizers_a_few_rows_at_a_time():
    """log_softmax_nll over [3, 50, vocab] (more positions than one chunk of NLL_ROWS, and a ragged last one) equals
    torch's float64 log_softmax; a graph run's windows are bounded by the bytes of logits they return (V2-Lite's
    102400-token vocabulary: 5 windows of 256, one of 1024), so scoring a large vocabulary holds no GB-sized
    float64 temporaries; too little text is said in tokens."""
    import numpy as np
    import pytest

    from mla_deploy.errors import InputError
    from mla_deploy.runtime import scoring

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 50, 97)).astype(np.float32)
    targets = rng.integers(0, 97, (3, 50))
    want = -torch.log_softmax(torch.from_numpy(logits).double(), -1).gather(-1, torch.from_numpy(targets)[..., None])
    got = scoring.log_softmax_nll(logits, targets)
    assert got.shape == (3, 50) and scoring.NLL_ROWS < 150 and np.allclose(got, want[..., 0].numpy(), atol=1e-12)
    assert [scoring.runs_of(w, 102400) for w in (256, 1024, 4096)] == [5, 1, 1]
    assert scoring.runs_of(256, 4096) == 8  # the demo's: the most
    for ids, says in (([], "0 tokens to score"), ([5], "1 token to score")):
        with pytest.raises(InputError, match=f"{says}; scoring needs at least 2"):
            scoring.windows(ids, 4)


def _likeness():
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "python_likeness", Path(__file__).resolve().parents[1] / "scripts" / "python_likeness.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_python_likeness_check_tells_code_from_comments_and_broken_brackets():
    judge = _likeness().judge
    assert judge("def parse(path):\n    with open(path) as f:\n        return [line for line in f if line]\n").python
    assert judge("def f(x):\n    return g(x,\n             y) if x else None\n").python  # a continuation aligns freely
    assert judge('def f(x):\n    """A docstring\n  with any indent."""\n    return x or None\n').python
    assert judge("def f(x):\n    if x:\n        return (x +").python  # cut off mid-statement on its last line: fine
    assert judge('def f(self, x=None, y=True):\n    """Return x."""\n').python  # a docstring is an indented statement
    assert not judge('def f(self, x=None, y=True):\n"""Return x."""\n').python
    comments = judge("def #\n#\n# == Message.\n#\n    return x if x else None\n")
    assert not comments.python and "comments" in " ".join(comments.reasons())
    closing = judge("def f(x):\n    return x)\n    if x: pass\n")
    assert not closing.python and "closes" in closing.brackets
    left_open = judge("def f(x:\n    return x\n    if x: pass\n")
    assert not left_open.python and "left open" in left_open.brackets
    assert not judge("def  0x00f4: 0x0378, #  CYRILLIC CAPITAL LETTER I\n").python  # a codec table: 1 keyword
    assert "off the 4-space grid" in " ".join(judge("def f(x):\n   return x\n    if x: pass\n").reasons())


def test_the_text_itself_is_the_held_out_files_own_continuation_of_the_prompt():
    from pathlib import Path

    likeness = _likeness()
    demo = Path(__file__).resolve().parents[1] / "mla_deploy" / "models" / "demo"
    texts = likeness.text_itself(demo, "def ", runs=6, max_new_tokens=64)
    assert len(texts) == 6 and len(set(texts)) == 6
    from train_demo import stdlib_files  # on the path: text_itself takes the held-out split from it

    held_out = [path.read_text(errors="replace") for path in stdlib_files()[1]]
    for text in texts:
        assert text.startswith("def ") and len(text) > 64  # 64 tokens of source, not characters
        assert any(text in source for source in held_out)  # the file's own text, decoded back exactly
    assert texts == likeness.text_itself(demo, "def ", runs=6, max_new_tokens=64)  # the same places every time



def test_the_training_script_writes_the_shipped_sampling_defaults_and_chat_template():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train_demo

    shipped = json.loads((DEMO / "generation_config.json").read_text())
    assert {k: shipped[k] for k in train_demo.GENERATION} == train_demo.GENERATION
    assert json.loads((DEMO / "tokenizer_config.json").read_text())["chat_template"] == train_demo.CHAT_TEMPLATE


def test_a_window_past_the_exports_length_is_named_as_given(demo_export_dir, tmp_path):
    """The window asked for, not the text's length it would be cut to."""
    import pytest

    from mla_deploy.errors import InputError

    text = tmp_path / "text.txt"
    text.write_text((DEMO / "heldout.txt").read_text()[:2000])
    length = ExportedModel(demo_export_dir).max_seq_len
    with pytest.raises(InputError, match=f"window 5000 exceeds the export's maximum length {length}"):
        evaluate(demo_export_dir, text, window=5000)
