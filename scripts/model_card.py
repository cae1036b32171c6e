"""Write the demo model's card from measurements: export it, score heldout.txt with `mla-deploy eval`'s code,
record eval.json, and fill README.md from training.json and eval.json.

    .venv/bin/python scripts/model_card.py mla_deploy/models/demo
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

from mla_deploy.evaluate import evaluate
from mla_deploy.export import ExportOptions, export

WINDOW = 256


def main(directory: str) -> None:
    demo = Path(directory)
    training = json.loads((demo / "training.json").read_text())
    config = json.loads((demo / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        export(demo, out, ExportOptions())
        report = evaluate(out, demo / "heldout.txt", window=WINDOW)
    print("\n".join(report.lines()))
    card = {"text": "heldout.txt", "window": WINDOW, "tokens": report.tokens, "loss": round(report.export_loss, 6),
            "torch_loss": round(report.torch_loss, 6), "perplexity": round(math.exp(report.export_loss), 3)}
    (demo / "eval.json").write_text(json.dumps(card, indent=2) + "\n")
    size_mb = (demo / "model.safetensors").stat().st_size / 2**20
    (demo / "README.md").write_text(f"""# mla-deploy demo model

A small language model of Python source code, trained by this project so that the first
`mla-deploy export` / `mla-deploy run` shows real text offline. It is an ordinary Hugging Face
checkpoint in the DeepseekV3 layout and loads through exactly the code path of a downloaded one.

| | |
|---|---|
| architecture | `DeepseekV3ForCausalLM`: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {config['num_attention_heads']} heads, MLA with q LoRA {config['q_lora_rank']}, kv_lora_rank {config['kv_lora_rank']}, decoupled RoPE {config['qk_rope_head_dim']}; layer 0 dense, layers 1-{config['num_hidden_layers'] - 1} MoE ({config['n_routed_experts']} routed experts of {config['moe_intermediate_size']} in {config['n_group']} groups, top-{config['num_experts_per_tok']} of the best {config['topk_group']} groups by `noaux_tc`, {config['n_shared_experts']} shared) |
| parameters | {training['parameters'] / 1e6:.2f} M ({size_mb:.1f} MB float32, tied embeddings) |
| tokenizer | byte-level BPE, {config['vocab_size']} tokens, trained with `tokenizers` on the training files; `<|pad|>` 0, `<|bos|>` 1, `<|eos|>` 2 |
| data | the Python {training['python']} standard library's own `.py` files (test suites excluded), PSF-licensed: {training['train_files']} files / {training['train_tokens']:,} tokens for training, every 25th file held out ({training['heldout_files']} files / {training['heldout_tokens']:,} tokens) |
| training | {training['steps']} steps of {training['batch']} x {training['seq']} tokens, AdamW lr {training['lr']}, seed {training['seed']}; router bias balanced without auxiliary loss (DeepSeek-V3 style); {training['train_minutes']} min on 2 CPU cores ({training['total_minutes']} min with tokenizer and data){'; ' + training['note'] if training.get('note') else ''} |
| held-out loss | **{card['loss']:.4f}** nats/token (perplexity {card['perplexity']:.2f}) on `heldout.txt` ({card['tokens']:,} tokens from {', '.join(training['heldout_sample_files'])}, windows of {WINDOW}); torch source {card['torch_loss']:.4f}. The training script's own figure over 64 windows of all held-out files: {training['heldout_loss_64x256']:.4f} |

Reproduce the held-out figure on an export:

    mla-deploy export mla_deploy/models/demo -o out/demo    # already there after scripts/demo
    mla-deploy eval out/demo --text mla_deploy/models/demo/heldout.txt

Retrain from scratch (same seed, same files, same numbers up to floating-point reduction order):

    .venv/bin/python scripts/train_demo.py --out mla_deploy/models/demo
""")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    main(sys.argv[1] if len(sys.argv) > 1 else "mla_deploy/models/demo")
