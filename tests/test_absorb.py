"""Weight surgery (export/absorb.py) as pure functions: the absorbed matrices against float64 products written
out per head, dtypes kept, and the byte counts `--absorb auto` decides by against the tensors themselves.
Shapes are chosen so no two dimensions coincide (d != h·d_v != q_in), which the model-level tests cannot."""

import dataclasses

import numpy as np
import pytest

from mla_deploy.config import MLAConfig
from mla_deploy.export import absorb
from mla_deploy.export.absorb import AbsorbMode
from mla_deploy.presets import preset_config
from mla_deploy.rope import deinterleave_perm


def config(**changes) -> MLAConfig:
    base = dict(hidden_size=48, num_attention_heads=3, qk_nope_head_dim=10, qk_rope_head_dim=4, v_head_dim=14,
                kv_lora_rank=20, q_lora_rank=36)
    return MLAConfig.from_hf_dict({**preset_config("tiny-v3"), **base, **changes})


@pytest.fixture(params=[36, None], ids=["q_lora", "no_q_lora"])
def cfg(request):
    return config(q_lora_rank=request.param)


def weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    h, dn, dr, dv, dc = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    q_in = cfg.q_lora_rank or cfg.hidden_size
    q = rng.standard_normal((h * (dn + dr), q_in), dtype=np.float32)
    kv_b = rng.standard_normal((h * (dn + dv), dc), dtype=np.float32)
    o = rng.standard_normal((cfg.hidden_size, h * dv), dtype=np.float32)
    return q, kv_b, o


def test_fused_matrices_are_the_per_head_products(cfg):
    q, kv_b, o = weights(cfg)
    h, dn, dr, dv, dc = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    fused_q = absorb.fused_query_absorb(cfg, q, kv_b)
    fused_o = absorb.fused_output_absorb(cfg, o, kv_b)
    assert fused_q.dtype == np.float32 and fused_o.dtype == np.float32
    q64, kv64, o64 = (w.astype(np.float64) for w in (q, kv_b, o))
    for head in range(h):
        w_uq = q64[head * (dn + dr) : head * (dn + dr) + dn]  # [d_nope, in]
        w_uk = kv64[head * (dn + dv) : head * (dn + dv) + dn]  # [d_nope, d_c]
        w_uv = kv64[head * (dn + dv) + dn : (head + 1) * (dn + dv)]  # [d_v, d_c]
        w_o = o64[:, head * dv : (head + 1) * dv]  # [d, d_v]
        np.testing.assert_allclose(fused_q[:, head * dc : (head + 1) * dc], (w_uk.T @ w_uq).T, rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(fused_o[head * dc : (head + 1) * dc], (w_o @ w_uv).T, rtol=1e-6, atol=1e-5)


def test_query_rows_split_per_head_with_rope_rows_rotate_half(cfg):
    q, kv_b, _ = weights(cfg)
    h, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    perm = deinterleave_perm(cfg)
    whole, nope, rope = absorb.query_weight(cfg, q), absorb.query_nope_weight(cfg, q), absorb.query_rope_weight(cfg, q)
    assert (
        whole.shape == (q.shape[1], h * (dn + dr))
        and nope.shape == (q.shape[1], h * dn)
        and rope.shape == (q.shape[1], h * dr)
    )
    for head in range(h):
        rows = q[head * (dn + dr) : (head + 1) * (dn + dr)]
        assert (nope[:, head * dn : (head + 1) * dn] == rows[:dn].T).all()
        assert (rope[:, head * dr : (head + 1) * dr] == rows[dn:][perm].T).all()
        assert (
            whole[:, head * (dn + dr) : (head + 1) * (dn + dr)] == np.concatenate([rows[:dn], rows[dn:][perm]]).T
        ).all()


def test_factored_matrices_are_kv_b_split_per_head(cfg):
    _, kv_b, _ = weights(cfg)
    h, dn, dv, dc = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    uk, uv = absorb.factored_uk(cfg, kv_b), absorb.factored_uv(cfg, kv_b)
    assert uk.shape == (h, dn, dc) and uv.shape == (h, dc, dv) and uk.flags.c_contiguous and uv.flags.c_contiguous
    for head in range(h):
        assert (uk[head] == kv_b[head * (dn + dv) : head * (dn + dv) + dn]).all()
        assert (uv[head] == kv_b[head * (dn + dv) + dn : (head + 1) * (dn + dv)].T).all()


def test_gate_up_puts_gate_columns_first():
    rng = np.random.default_rng(1)
    gate, up = rng.standard_normal((5, 7)), rng.standard_normal((5, 7))
    assert (absorb.gate_up_weight(gate, up) == np.concatenate([gate.T, up.T], axis=1)).all()


@pytest.mark.parametrize("itemsize", [4, 2])
def test_absorbed_bytes_are_the_bytes_of_the_matrices_a_decode_token_reads(cfg, itemsize):
    q, kv_b, o = weights(cfg)
    rope = absorb.query_rope_weight(cfg, q).size  # both forms read the query's rope rows
    fused = rope + absorb.fused_query_absorb(cfg, q, kv_b).size + absorb.fused_output_absorb(cfg, o, kv_b).size
    factored = (rope + absorb.query_nope_weight(cfg, q).size + absorb.factored_uk(cfg, kv_b).size
                + absorb.factored_uv(cfg, kv_b).size + o.size)
    assert absorb.absorbed_weight_bytes(cfg, AbsorbMode.FUSED, itemsize) == fused * itemsize
    assert absorb.absorbed_weight_bytes(cfg, AbsorbMode.FACTORED, itemsize) == factored * itemsize
    assert absorb.absorbed_weight_bytes(cfg, AbsorbMode.FACTORED) == factored * 4  # float32 by default


def test_auto_picks_fewer_bytes_and_factored_on_a_tie():
    # one head, q_in = d = d_c = 64, d_nope = d_v = 32: fused 2·64·64 = factored 64·32 + 32·64 + 64·32 + 32·64
    tie = config(
        num_attention_heads=1, hidden_size=64, kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None
    )
    assert absorb.absorbed_weight_bytes(tie, AbsorbMode.FUSED) == absorb.absorbed_weight_bytes(tie, AbsorbMode.FACTORED)
    assert absorb.resolve_absorb(tie, "auto") == AbsorbMode.FACTORED  # the smaller matrices
    small_latent = dataclasses.replace(tie, kv_lora_rank=8)
    assert absorb.resolve_absorb(small_latent, "auto") == AbsorbMode.FUSED
    assert (
        absorb.resolve_absorb(tie, "fused") == AbsorbMode.FUSED
        and absorb.resolve_absorb(small_latent, "factored") == AbsorbMode.FACTORED
    )
