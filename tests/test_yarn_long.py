"""YaRN past the original context, through the exported graphs against transformers: checkpoints whose
original_max_position_embeddings is 256 (factor 4, context 1024), a 640-token prompt through the prefill graph and
128 decode steps after it, to three times the original context; V2 (interleaved rope pairs, mscale 0.707) and V3
(rotate-half, mscale 1); float32 caches against transformers' own logits, an int8 cache against the source with its
cache rounded as written."""

import numpy as np
import pytest
import torch

from mla_deploy import io_spec
from mla_deploy.checkpoint import Checkpoint
from mla_deploy.export import ExportOptions, export
from mla_deploy.io_spec import CacheFormat
from mla_deploy.modeling.layerwise import layerwise_logits
from mla_deploy.runtime import ExportedModel, RuntimeOptions
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.verify import decode_steps
from tiny import build_hf_model, save_hf_model

ORIGINAL, CONTEXT, PROMPT, STEPS = 256, 1024, 640, 128
YARN = {"rope_type": "yarn", "factor": CONTEXT / ORIGINAL, "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
BASES = {"v2_nolora_greedy_yarn": {"mscale": 0.707, "mscale_all_dim": 0.707},
         "v3_nointerleave_ungrouped": {"mscale": 1.0, "mscale_all_dim": 1.0}}


@pytest.fixture(scope="module", params=sorted(BASES))
def long_yarn(request, tmp_path_factory):
    base = request.param
    hf = build_hf_model(base, rope_parameters={**YARN, **BASES[base]}, max_position_embeddings=CONTEXT)
    src = tmp_path_factory.mktemp(f"yarn-{base}") / "ckpt"
    save_hf_model(hf, src)
    ids = torch.randint(3, hf.config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits[0].numpy()  # [PROMPT + STEPS, vocab]
    return src, ids.numpy(), ref


def _run_export(model, ids):
    """The prompt through the prefill graph, then each following token through the decode graph: logits at every
    position [PROMPT + STEPS, vocab]."""
    feed = prefill_feed(model.config, ids[:, :PROMPT], PROMPT + STEPS, model.cache_format)
    prefilled = model.run("prefill", feed)
    caches = {io_spec.past_of(k): v for k, v in prefilled.items() if k.startswith("present_")}
    steps = decode_steps(model, caches, ids[:, PROMPT:], np.array([PROMPT]), np.ones((1, PROMPT + STEPS), np.int64))
    return np.concatenate([prefilled["logits"][0], np.stack(steps)[:, 0]])


@pytest.mark.parametrize("absorb", ["factored", "fused"])
def test_past_the_original_context_the_graphs_match_transformers(long_yarn, tmp_path, absorb):
    src, ids, ref = long_yarn
    out = tmp_path / "out"
    export(src, out, ExportOptions(absorb=absorb, experts="branches"))
    ours = _run_export(ExportedModel(out), ids)
    scale = max(1.0, float(np.abs(ref).max()))
    assert scale > 2  # logits that are not near zero
    # the step that predicts past position 3 x 256, and every other, within float32's verify tolerance
    assert np.abs(ours - ref).max() <= 1e-4 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_past_the_original_context_an_int8_cache_matches_its_rounded_source(long_yarn, tmp_path):
    src, ids, _ = long_yarn
    out = tmp_path / "out"
    export(src, out, ExportOptions(cache_dtype="int8", experts="branches"))
    ours = _run_export(ExportedModel(out, RuntimeOptions(kernels=False)), ids)  # the exact int8 attention, as verify
    mask = torch.ones(1, PROMPT + STEPS)
    ref_prefill, ref_steps = layerwise_logits(Checkpoint(src), torch.from_numpy(ids[:, :PROMPT]), mask,
                                              torch.tensor([PROMPT]), torch.from_numpy(ids[:, PROMPT:]),
                                              stored=CacheFormat("int8", "float32"))
    ref = np.concatenate([ref_prefill[0].numpy(), ref_steps[0].numpy()])
    assert np.abs(ours - ref).max() <= 1e-3 * max(1.0, float(np.abs(ref).max()))
