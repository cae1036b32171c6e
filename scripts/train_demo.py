"""Train the bundled demo model: a small DeepseekV3-layout MLA model on the Python standard library's source,
with DeepSeek-V3's multi-token-prediction (MTP) module trained jointly.

    nice .venv/bin/python scripts/train_demo.py --out mla_deploy/models/demo   # its time: the model card

Reproducible from --seed: the file list is sorted, the held-out split is by file, batches come from
one seeded generator, and torch runs deterministic CPU kernels. The model is transformers' own
DeepseekV3ForCausalLM (MLA with q LoRA and decoupled RoPE, MoE layers with a shared expert and
grouped noaux_tc routing), saved with save_pretrained, so it loads exactly like a downloaded
checkpoint. The router's e_score_correction_bias is trained the DeepSeek-V3 way (auxiliary-loss-free
balancing: nudged toward under-used experts after each step).

The MTP module (DeepSeek-V3, section 2.2) is trained jointly with the main model, as DeepSeek did: at position i
it reads the main model's final hidden state h_i (after the final norm) and the embedding of token i + 1,
h' = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]), runs one more decoder block (MoE, as the layer index
num_hidden_layers is in V3) and the shared head (shared_head.norm, then the tied output layer) to predict token
i + 2. The loss is main + lambda x MTP with DeepSeek-V3's lambda: 0.3 for the first two thirds of the steps, 0.1
after. It is saved as DeepSeek-V3 checkpoints store it, layer index num_hidden_layers (model.layers.4.*: enorm,
hnorm, eh_proj, the block, shared_head.norm); the embedding and head it shares are not stored twice.
transformers' DeepseekV3ForCausalLM does not use those weights.

Prompts that end in a space (`def `) end in the lone space token, which the canonical tokenization of the
training text puts almost only before aligned comments and tables. So each training window splits a
SPACE_SPLIT_RATE share of its space-word tokens (`Ġname`, where `name` is a token too) into the space and the
word, with no loss on predicting the inserted space: the model learns what follows a lone space without
learning to emit one.
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
import torch.nn.functional as F

HELDOUT_EVERY = 25  # every 25th file (sorted) is held out
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>"]
IGNORE = -100  # cross_entropy's ignore_index: no loss on that target
SPACE_SPLIT_RATE = 0.05
MTP_WEIGHTS = (0.3, 0.1)  # DeepSeek-V3's lambda: the first two thirds of training, then the rest

# what the demo ships beside its weights: sampling defaults chosen from measured samples (docs/serving.md, "The demo's
# sampling defaults") and a chat template that turns messages into comments and the reply into code, opening with the
# BOS the model was trained after (a chat prompt is tokenized without the tokenizer's own: runtime/chat.py)
GENERATION = dict(do_sample=True, temperature=0.7, top_p=0.9, repetition_penalty=1.1)
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
                 "{{ message['content'] }}\n{% else %}{% for line in message['content'].split('\\n') %}# {{ line }}\n"
                 "{% endfor %}{% endif %}{% endfor %}")

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


def space_splits(tok) -> tuple[int, torch.Tensor]:
    """The lone space token's id, and for every token id the id of the same token without its leading space (-1 where
    there is none: no leading space, or the rest is not a token)."""
    vocab = tok.get_vocab()
    space = vocab["Ġ"]
    rest = torch.full((len(vocab),), -1, dtype=torch.long)
    for token, i in vocab.items():
        if token.startswith("Ġ") and len(token) > 1 and token[1:] in vocab:
            rest[i] = vocab[token[1:]]
    return space, rest


def batches(stream: torch.Tensor, seq: int, batch: int, gen: torch.Generator, space: int, rest: torch.Tensor):
    """(x, y) [batch, seq] windows of the stream, a SPACE_SPLIT_RATE share of their space-word tokens split in two;
    y is IGNORE where it is an inserted space."""
    while True:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])  # [batch, seq + 1]
        split = (torch.rand(chunk.shape, generator=gen) < SPACE_SPLIT_RATE) & (rest[chunk] >= 0)
        split[:, 0] = False  # the window's first token has no target before it to mask
        ids, targets = [], []
        for row, marks in zip(chunk.tolist(), split.tolist()):
            out, inserted = [], []
            for token, cut in zip(row, marks):
                if cut:
                    out += [space, int(rest[token])]
                    inserted += [True, False]
                else:
                    out.append(token)
                    inserted.append(False)
            out, inserted = out[: seq + 1], inserted[: seq + 1]
            ids.append(out)
            targets.append([IGNORE if cut else t for t, cut in zip(out, inserted)])
        ids, targets = torch.tensor(ids), torch.tensor(targets)
        yield ids[:, :-1], targets[:, 1:]


class MTP(torch.nn.Module):
    """DeepSeek-V3's MTP module from transformers' own DeepseekV3 pieces, its parameters named as a checkpoint's
    layer num_hidden_layers holds them (the block's at the layer's top level)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = DeepseekV3RMSNorm(d, eps), DeepseekV3RMSNorm(d, eps)
        self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
        self.block = DeepseekV3DecoderLayer(config, config.num_hidden_layers)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(d, eps)

    def forward(self, embeds, hidden, position_embeddings):
        """embeds of tokens i + 1, main hidden states at i (after the final norm) [b, T, d] -> normed [b, T, d]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x = self.block(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.shared_head.norm(x)

    def checkpoint_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        return {f"model.layers.{layer}.{name.removeprefix('block.')}": value.detach().contiguous()
                for name, value in self.state_dict().items()}


def losses(model, mtp, x, y):
    """(main, MTP) mean cross-entropies of a batch; the MTP at i predicts y[i + 1] from h_i and x[i + 1]."""
    out = model.model(x)
    hidden = out.last_hidden_state  # after the final norm
    main = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    t = x.shape[1] - 1
    positions = torch.arange(t)[None].expand(x.shape[0], -1)
    rope = model.model.rotary_emb(hidden, positions)
    predicted = model.lm_head(mtp(model.model.embed_tokens(x[:, 1:]), hidden[:, :-1], rope))  # [b, T - 1, vocab]
    return main, F.cross_entropy(predicted.flatten(0, 1), y[:, 1:].flatten(), ignore_index=IGNORE)


@torch.no_grad()
def heldout(model, mtp, stream: torch.Tensor, seq: int, max_windows: int = 64) -> dict:
    """Over windows of the held-out stream: the main loss, the MTP's loss, how often the MTP's likeliest token is the
    text's token i + 2, and how often it is the main model's likeliest at i + 1 given the text up to i + 1 (what a
    greedy first draft token's acceptance measures)."""
    model.eval()
    mtp.eval()
    windows = [stream[i : i + seq + 1] for i in range(0, len(stream) - seq - 1, seq)][:max_windows]
    main = extra = hits = agree = 0.0
    for w in windows:
        x, y = w[None, :-1], w[None, 1:]
        hidden = model.model(x).last_hidden_state
        logits = model.lm_head(hidden)[0]  # [T, vocab]
        rope = model.model.rotary_emb(hidden, torch.arange(seq - 1)[None])
        drafted = model.lm_head(mtp(model.model.embed_tokens(x[:, 1:]), hidden[:, :-1], rope))[0]  # [T - 1, vocab]
        main += F.cross_entropy(logits, y[0], reduction="sum").item()
        extra += F.cross_entropy(drafted, y[0, 1:], reduction="sum").item()
        guess = drafted.argmax(-1)
        hits += (guess == y[0, 1:]).sum().item()
        agree += (guess == logits[1:].argmax(-1)).sum().item()
    model.train()
    mtp.train()
    n = len(windows)
    return {"loss": main / (n * seq), "mtp_loss": extra / (n * (seq - 1)), "mtp_top1_text": hits / (n * (seq - 1)),
            "mtp_top1_agrees_with_main": agree / (n * (seq - 1))}


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
    p.add_argument("--steps", type=int, default=1500)
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
    mtp = MTP(config)
    mtp.apply(model._init_weights)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters, MTP module {n_mtp / 1e6:.2f} M", flush=True)
    counts = {}
    for layer in [*model.model.layers, mtp.block]:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            counts[gate] = torch.zeros(config.n_routed_experts)
            gate.register_forward_hook(count_routing(counts))

    opt = torch.optim.AdamW([*model.parameters(), *mtp.parameters()], lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.seq, args.batch, gen, *space_splits(tok))
    model.train()
    mtp.train()
    t_train = time.time()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        main, extra = losses(model, mtp, x, y)
        loss = main + MTP_WEIGHTS[step > args.steps * 2 // 3] * extra
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *mtp.parameters()], 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            balance_router_bias(model, counts, 1e-3)
        if step % 50 == 0 or step == 1:
            print(f"step {step:5d}  loss {main.item():.3f}  mtp {extra.item():.3f}  "
                  f"{(time.time() - t_train) / step:.2f} s/step", flush=True)
    train_minutes = (time.time() - t_train) / 60
    held = heldout(model, mtp, held_ids, args.seq)
    print(
        f"held-out loss {held['loss']:.4f} (perplexity {math.exp(held['loss']):.2f}), MTP loss {held['mtp_loss']:.4f}, "
        f"MTP top-1 = text {held['mtp_top1_text']:.3f}, = main's {held['mtp_top1_agrees_with_main']:.3f}; "
        f"after {train_minutes:.1f} min",
        flush=True,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.update(**GENERATION)
    model.eval().save_pretrained(args.out)
    from safetensors.torch import load_file, save_file

    weights = args.out / "model.safetensors"
    save_file({**load_file(weights), **mtp.checkpoint_tensors(config.num_hidden_layers)}, weights,
              metadata={"format": "pt"})
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "add_bos_token": True, "model_max_length": MODEL["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE}, indent=2))
    (args.out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2))
    heldout_text = "\n".join(f.read_text(errors="replace") for f in held_files[:4])
    (args.out / "heldout.txt").write_text(heldout_text)
    (args.out / "training.json").write_text(json.dumps({
        "seed": args.seed, "steps": args.steps, "seq": args.seq, "batch": args.batch, "lr": args.lr,
        "python": sys.version.split()[0], "train_files": len(train_files), "heldout_files": len(held_files),
        "train_tokens": len(train_ids), "heldout_tokens": len(held_ids), "parameters": n_params,
        "mtp_parameters": n_mtp, "mtp_weights": list(MTP_WEIGHTS), "space_split_rate": SPACE_SPLIT_RATE,
        "train_minutes": round(train_minutes, 1), "total_minutes": round((time.time() - t_start) / 60, 1),
        "heldout_loss_64x256": round(held["loss"], 4), "heldout_mtp_64x256": {k: round(v, 4) for k, v in held.items()},
        "heldout_sample_files": [f.name for f in held_files[:4]],
    }, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)
    sys.path.insert(0, str(Path(__file__).parent))
    import model_card

    model_card.main(str(args.out))  # export, eval heldout.txt, write eval.json and the model card


if __name__ == "__main__":
    main()
