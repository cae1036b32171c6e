"""Tiny checkpoints built with transformers' own DeepseekV2/V3 classes: the reference for every parity test.

Weights use a larger init than transformers' default (std 0.02 makes every logit ~0 and every
comparison trivially close), and the V3 router bias is random so that it changes the routing.
"""

from __future__ import annotations

import torch

YARN_V3 = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
YARN_V2 = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32,
           "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
NO_SCALING = {"rope_type": "default", "rope_theta": 10000.0}

_COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_position_embeddings=256, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# name -> (architecture, overrides). Covers: q LoRA on/off, both routers and all topk methods,
# YaRN with mscale 1 and 0.707, no scaling, dense-only, tied embeddings, non-interleaved rope.
VARIANTS = {
    "v3_lora_group_yarn": ("v3", dict(q_lora_rank=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                                      n_group=4, topk_group=2, first_k_dense_replace=1, rope_parameters=YARN_V3,
                                      routed_scaling_factor=2.5, norm_topk_prob=True)),
    "v2_nolora_greedy_yarn": ("v2", dict(q_lora_rank=None, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                                         topk_method="greedy", first_k_dense_replace=1, rope_parameters=YARN_V2,
                                         routed_scaling_factor=1.0)),
    "v2_group_limited": ("v2", dict(q_lora_rank=20, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                    topk_method="group_limited_greedy", n_group=4, topk_group=2, first_k_dense_replace=1,
                                    rope_parameters=NO_SCALING, routed_scaling_factor=16.0)),
    "v3_dense_tied": ("v3", dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                 first_k_dense_replace=3, tie_word_embeddings=True, rope_parameters=NO_SCALING)),
    "v3_nointerleave_ungrouped": ("v3", dict(q_lora_rank=None, n_routed_experts=6, n_shared_experts=1,
                                             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                                             norm_topk_prob=False, rope_interleave=False, rope_parameters=YARN_V3)),
}


def hf_classes(arch: str):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    return (DeepseekV2Config, DeepseekV2ForCausalLM) if arch == "v2" else (DeepseekV3Config, DeepseekV3ForCausalLM)


def build_hf_model(variant: str, seed: int = 0, **extra):
    arch, overrides = VARIANTS[variant]
    config_cls, model_cls = hf_classes(arch)
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **overrides, **extra})
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.3)
            if gate is not None:
                gate.weight.normal_(0, 0.3)
    return model


def save_hf_model(model, directory, **kwargs) -> None:
    model.save_pretrained(directory, **kwargs)


class HFMTP(torch.nn.Module):
    """DeepSeek-V3's MTP module from transformers' own DeepseekV3 pieces (as vLLM and SGLang build it): the reference
    the source model's modeling.mtp is checked against. forward: embeddings of tokens i + 1 and the main model's
    hidden states at i (after its final norm) -> the state the shared head reads."""

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
        t = embeds.shape[1]
        causal = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]  # eager attention adds it
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(self.block(x, attention_mask=causal, position_embeddings=position_embeddings))


def add_mtp_layer(model, directory, seed: int = 1) -> HFMTP:
    """Random MTP weights (layer num_hidden_layers, DeepSeek-V3's layout) for a tiny V3 `model` saved in `directory`,
    appended to its model.safetensors; returns the reference module holding them."""
    from mla_deploy.safetensors_io import SafetensorsFile, write_safetensors

    torch.manual_seed(seed)
    mtp = HFMTP(model.config).eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.08 * torch.randn_like(p))
        gate = mtp.block.mlp.gate
        gate.e_score_correction_bias.normal_(0, 0.3)
    layer = model.config.num_hidden_layers
    added = {f"model.layers.{layer}.{n.removeprefix('block.')}": v.detach().numpy().copy()
             for n, v in mtp.state_dict().items()}
    path = directory / "model.safetensors"
    f = SafetensorsFile(path)
    state = {n: f.float32(n) for n in f.entries}
    del f
    write_safetensors(path, {**state, **added})
    return mtp
