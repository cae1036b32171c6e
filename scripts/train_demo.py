"""Train the bundled demo model: a small DeepseekV3-layout MLA model on the Python standard library's source.

    .venv/bin/python scripts/train_demo.py --out mla_deploy/models/demo        # about 20 minutes on 2 cores

Reproducible from --seed: the file list is sorted, the held-out split is by file, batches come from
one seeded generator, and torch runs deterministic CPU kernels. The model is transformers' own
DeepseekV3ForCausalLM (MLA with q LoRA and decoupled RoPE, MoE layers with a shared expert and
grouped noaux_tc routing), saved with save_pretrained, so it loads exactly like a downloaded
checkpoint. The router's e_score_correction_bias is trained the DeepSeek-V3 way (auxiliary-loss-free
balancing: nudged toward under-used experts after each step).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

HELDOUT_EVERY = 25  # every 25th file (sorted) is held out
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>"]

MODEL = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=640, moe_intermediate_size=160, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
    topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py")
                   if not skip & set(p.relative_to(root).parts) and p.stat().st_size < 400_000)
    held = files[::HELDOUT_EVERY]
    return [f for f in files if f not in held], held


def train_tokenizer(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    assert [tok.token_to_id(s) for s in SPECIAL] == [0, 1, 2]
    return tok


def encode_files(tok, files: list[Path]) -> torch.Tensor:
    ids = []
    for f in files:
        ids += tok.encode(f.read_text(errors="replace")).ids + [2]  # <|bos|> file <|eos|>
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, seq: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq: int, max_windows: int = 64) -> float:
    model.eval()
    windows = [stream[i : i + seq + 1] for i in range(0, len(stream) - seq - 1, seq)][:max_windows]
    total, count = 0.0, 0
    for w in windows:
        logits = model(w[None, :-1]).logits[0]
        total += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
        count += seq
    model.train()
    return total / count


def count_routing(counts: dict):
    def hook(gate, _inputs, out):  # out = (router_logits, topk_weights, topk_indices)
        counts[gate] += torch.bincount(out[2].flatten(), minlength=len(counts[gate]))

    return hook


def balance_router_bias(model, counts: dict, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-used experts, lower over-used ones."""
    for gate, load in counts.items():
        gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("mla_deploy/models/demo"))
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t_start = time.time()
    train_files, held_files = stdlib_files()
    tok = train_tokenizer(train_files, MODEL["vocab_size"])
    train_ids, held_ids = encode_files(tok, train_files), encode_files(tok, held_files)
    print(f"data: {len(train_files)} train files ({len(train_ids):,} tokens), {len(held_files)} held-out "
          f"({len(held_ids):,} tokens)", flush=True)

    config = DeepseekV3Config(**MODEL)
    config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    counts = {}
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            counts[gate] = torch.zeros(config.n_routed_experts)
            gate.register_forward_hook(count_routing(counts))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.seq, args.batch, gen)
    model.train()
    t_train = time.time()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            balance_router_bias(model, counts, 1e-3)
        if step % 50 == 0 or step == 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {(time.time() - t_train) / step:.2f} s/step", flush=True)
    train_minutes = (time.time() - t_train) / 60
    held = heldout_loss(model, held_ids, args.seq)
    print(f"held-out loss {held:.4f} (perplexity {math.exp(held):.2f}) after {train_minutes:.1f} min", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "add_bos_token": True, "model_max_length": MODEL["max_position_embeddings"]}, indent=2))
    (args.out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2))
    heldout_text = "\n".join(f.read_text(errors="replace") for f in held_files[:4])
    (args.out / "heldout.txt").write_text(heldout_text)
    (args.out / "training.json").write_text(json.dumps({
        "seed": args.seed, "steps": args.steps, "seq": args.seq, "batch": args.batch, "lr": args.lr,
        "python": sys.version.split()[0], "train_files": len(train_files), "heldout_files": len(held_files),
        "train_tokens": len(train_ids), "heldout_tokens": len(held_ids), "parameters": n_params,
        "train_minutes": round(train_minutes, 1), "total_minutes": round((time.time() - t_start) / 60, 1),
        "heldout_loss_64x256": round(held, 4), "heldout_sample_files": [f.name for f in held_files[:4]],
    }, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)
    sys.path.insert(0, str(Path(__file__).parent))
    import model_card

    model_card.main(str(args.out))  # export, eval heldout.txt, write eval.json and the model card


if __name__ == "__main__":
    main()
