"""lm-evaluation-harness against `serve`: a tiny local multiple-choice task (tests/lm_eval: a task YAML and its
JSON-lines data, no download) through lm-eval's local-completions model, batch size 4, compared with the same
loglikelihoods computed through mla-deploy's Python API (the export's prefill graph, no server)."""

from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness (lm-eval[api], a test dependency)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from serving import running_server  # noqa: E402

from mla_deploy import io_spec  # noqa: E402
from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402
from mla_deploy.runtime import ExportedModel, Tokenizer  # noqa: E402
from mla_deploy.runtime.feeds import prefill_feed  # noqa: E402
from mla_deploy.runtime.scoring import log_softmax_nll  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASK = "demo_next_line_tiny"


def loglikelihood(model: ExportedModel, tokenizer: Tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval asks for, through the runtime: its split (trailing whitespace of the context moves to the
    continuation), BOS first (add_bos_token=True), the continuation's summed logprob and whether it is greedy."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = tokenizer.encode(context + continuation), tokenizer.encode(context)
    ids = np.array([whole], np.int64)
    logits = model.run(io_spec.PREFILL, prefill_feed(model.config, ids[:, :-1]))[io_spec.LOGITS][0]
    rows = np.arange(len(head) - 1, len(whole) - 1)
    targets = ids[0, len(head):]
    return float(-log_softmax_nll(logits[rows], targets).sum()), bool((logits[rows].argmax(-1) == targets).all())


def test_lm_eval_local_completions_against_serve_equals_the_python_api(demo_export_dir, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task YAML names its data file relative to the repository root
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with running_server(demo_export_dir, max_batch=8) as (base, service):
        args = (f"model=demo,base_url={base}/v1/completions,tokenizer={DEMO_CHECKPOINT},tokenizer_backend=huggingface,"
                "max_length=1024,add_bos_token=True")
        results = simple_evaluate(model="local-completions", model_args=args, tasks=[TASK], batch_size=4,
                                  task_manager=TaskManager(include_path=str(ROOT / "tests/lm_eval")),
                                  log_samples=True)
        answered = service.status_counts.get(200, 0)
    samples = results["samples"][TASK]
    model, tokenizer = ExportedModel(demo_export_dir), Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    correct = 0
    assert len(samples) == 8 and answered == 8  # 8 documents x 4 choices, 4 prompts a request
    for sample in samples:
        doc = sample["doc"]
        ours = [loglikelihood(model, tokenizer, doc["context"], choice) for choice in doc["choices"]]
        theirs = [(float(r[0][0]), r[0][1] in (True, "True")) for r in sample["resps"]]
        assert np.allclose([o[0] for o in ours], [t[0] for t in theirs], rtol=0, atol=1e-4), doc["context"]
        assert [o[1] for o in ours] == [t[1] for t in theirs]
        correct += int(np.argmax([o[0] for o in ours]) == doc["label"])
    assert results["results"][TASK]["acc,none"] == pytest.approx(correct / len(samples))
