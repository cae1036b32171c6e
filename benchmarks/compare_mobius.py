"""mobius-onnx beside mla-deploy on the same checkpoint, in one process, interleaved point by point.

mobius-onnx is not a dependency. Build its export in a separate virtual environment (it needs
torch>=2.1, which the pinned torch 2.13.0 satisfies) from a copy of the checkpoint with packed experts
(it reads only `mlp.experts.gate_up_proj` / `down_proj`):

    python -m venv /tmp/mobvenv && /tmp/mobvenv/bin/pip install torch==2.13.0 mobius-onnx==0.1.0 onnxruntime==1.31.1
    /tmp/mobvenv/bin/mobius build --config PACKED_CHECKPOINT /tmp/mobout
    .venv/bin/python benchmarks/compare_mobius.py /tmp/mobout/model.onnx EXPORT_DIR CHECKPOINT

Prints decode step time at each context for both, and each one's max |Δlogit| against the torch source
on a 40-token prompt.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
import torch

from mla_deploy import io_spec
from mla_deploy.modeling import load_model, new_caches
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime.feeds import prefill_feed


def mobius_session(path: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def mobius_feed(cfg, ids: np.ndarray, past: int, rng) -> dict:
    b, t = ids.shape
    feed = {"input_ids": ids, "attention_mask": np.ones((b, past + t), np.int64),
            "position_ids": np.broadcast_to(np.arange(past, past + t), (b, t)).copy()}
    for i in range(cfg.num_hidden_layers):
        shape = (b, cfg.num_attention_heads, past)
        feed[f"past_key_values.{i}.key"] = rng.standard_normal((*shape, cfg.qk_head_dim), dtype=np.float32)
        feed[f"past_key_values.{i}.value"] = rng.standard_normal((*shape, cfg.v_head_dim), dtype=np.float32)
    return feed


def median_ms(fn, steps=6) -> float:
    for _ in range(3):  # warm-up: the first runs after loading touch the weights for the first time
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(mobius_path: str, export_dir: str, checkpoint: str, contexts=(128, 1024, 4096, 16384)) -> None:
    ours = ExportedModel(export_dir, RuntimeOptions(threads=2), graphs=("decode",))
    cfg = ours.config
    mob = mobius_session(mobius_path)
    gen = Generator(ours, SamplingParams(), stop_token_ids=())
    rng = np.random.default_rng(0)
    print(f"{'ctx':>6} {'mla-deploy ms':>14} {'mobius-onnx ms':>15} {'ratio':>6}")
    for ctx in contexts:
        state = gen.new_state([np.zeros(1, np.int64)], context=ctx)
        state.caches.ensure(ctx + 16)
        for arr in state.caches.arrays.values():
            arr[:] = rng.standard_normal(arr.shape, dtype=np.float32)
        token = np.array([5])
        feed = mobius_feed(cfg, token[None, :].astype(np.int64), ctx, rng)
        a = median_ms(lambda: gen.decode_step(state, token))
        b = median_ms(lambda: mob.run(["logits"], feed))
        print(f"{ctx:>6} {a:>14.1f} {b:>15.1f} {b / a:>6.2f}")
    ours = gen = None  # the sessions go before the torch model loads

    # accuracy on a prompt, against the torch source (both from an empty cache)
    model = load_model(checkpoint)
    ids = rng.integers(0, cfg.vocab_size, (1, 40))
    ref = model(torch.from_numpy(ids), torch.arange(40)[None], new_caches(cfg, 1, 40), torch.zeros(1, dtype=torch.long),
                torch.ones(1, 40)).numpy()
    mob_logits = mob.run(["logits"], mobius_feed(cfg, ids, 0, rng))[0]
    full = ExportedModel(export_dir, RuntimeOptions(threads=2), graphs=("prefill",))
    our_logits = full.run(io_spec.PREFILL, prefill_feed(cfg, ids))[io_spec.LOGITS]
    print(f"max |Δlogit| vs torch source, 40 tokens: mla-deploy {np.abs(our_logits - ref).max():.2e}, "
          f"mobius-onnx {np.abs(mob_logits - ref).max():.2e} (logit scale {np.abs(ref).max():.2f})")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    if len(sys.argv) != 4:
        sys.exit("usage: compare_mobius.py MOBIUS_ONNX EXPORT_DIR CHECKPOINT (--help says more)")
    main(*sys.argv[1:4])
