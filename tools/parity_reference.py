#!/usr/bin/env python3
"""Independent plain-torch forward for the parity fixtures (no transformers model code).

Reads tests/data/parity/<name>/model/ (config.json + safetensors, FP8 dequantized with weight_scale_inv,
compressed-tensors INT4 and ModelOpt NVFP4 decoded from their stored bytes),
recomputes the logits of golden/meta.json's prompt+tf and prompt+greedy sequences in float64 and reports
the max abs difference to golden/logits.npy and golden/greedy_logits.npy. It follows tools/HF_NOTES.md
literally (GPT-J pair RoPE instead of HF's de-interleaved layout, -inf group masking, DSA top-k with
shared-indexer layers, YaRN) and serves as an executable cross-check of those notes.

Usage: python tools/parity_reference.py [tests/data/parity] [--only glm5,...]
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

DT = torch.float64


def load_tensors(model_dir):
    files = sorted(Path(model_dir).glob("*.safetensors"))
    raw = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                raw[k] = h.get_tensor(k)
    out = {}
    for k, t in raw.items():
        if (k.endswith("_scale_inv") or k.endswith(".weight_scale") or k.endswith(".weight_shape")
                or k.endswith(".weight_zero_point")):
            continue
        if k.endswith(".weight_scale_2") or k.endswith(".input_scale"):
            continue
        if t.dtype == torch.uint8 and k + "_scale_2" in raw:
            # NVIDIA ModelOpt NVFP4: two E2M1 codes a byte (column 2j in the low nibble), an E4M3 scale per 16
            # columns, a per-tensor weight_scale_2: W = e2m1 * weight_scale[row, i / 16] * weight_scale_2.
            e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=DT)
            b = t.to(torch.int64)
            codes = torch.stack((b & 15, b >> 4), dim=-1).reshape(t.shape[0], -1)
            s = raw[k + "_scale"].to(DT)
            cols = codes.shape[1]
            out[k] = e2m1[codes] * s[:, torch.arange(cols) // 16] * raw[k + "_scale_2"].to(DT)
            continue
        if k.endswith(".weight_packed"):
            # compressed-tensors pack-quantized INT4: element i of a row at bits 4i of its int32
            # words (little-endian), stored as q + 8; W = q * weight_scale[row, i / group].
            base = k[: -len("_packed")]
            rows, cols = raw[base + "_shape"].tolist()
            words = t.numpy().astype("<i4").view("u1").reshape(rows, -1)
            nib = torch.from_numpy(words.copy()).to(torch.int64)
            q = torch.stack((nib & 15, nib >> 4), dim=-1).reshape(rows, -1)[:, :cols] - 8
            s = raw[base + "_scale"].to(DT)
            group = -(-cols // s.shape[1])
            if base + "_zero_point" in raw:
                # asymmetric: zp + 8 of row r, group g at bits 4(r % 8) of word [r / 8, g]; W = (q - zp) * s.
                zw = raw[base + "_zero_point"].numpy().astype("<i4").astype("int64")
                nib = (zw[:, :, None] >> (4 * np.arange(8))) & 15
                zp = torch.from_numpy(nib.transpose(0, 2, 1).reshape(-1, zw.shape[1])[:rows] - 8)
                q = q - zp[:, torch.arange(cols) // group]
            out[base] = q.to(DT) * s[:, torch.arange(cols) // group]
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = raw[k + "_scale_inv"].to(DT)
            w = t.to(DT)
            rows = torch.arange(w.shape[0]) // 128
            cols = torch.arange(w.shape[1]) // 128
            w = w * s[rows][:, cols]
            out[k] = w
        else:
            out[k] = t.to(DT)
    return out


def rms(x, w, eps):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def rope_pairs(x, ang):
    """GPT-J pairs (x[2i], x[2i+1]) rotated by ang[..., i]; x [..., d], ang broadcastable to [..., d/2]."""
    c, s = torch.cos(ang), torch.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x1 * c + x0 * s
    return out


def inv_freq_of(cfg):
    rp = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta"))
    dim = cfg["qk_rope_head_dim"]
    base = rp["rope_theta"]
    kind = rp.get("rope_type", rp.get("type", "default"))
    pos = torch.tensor([base ** (2 * i / dim) for i in range(dim // 2)], dtype=DT)
    if kind == "default":
        return 1.0 / pos, 1.0
    assert kind == "yarn"
    factor = rp["factor"]
    orig = rp["original_max_position_embeddings"]
    bf, bs = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr(n):
        return dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=DT) - low) / (high - low)).clamp(0, 1)
    inv = (1 / (factor * pos)) * ramp + (1 / pos) * (1 - ramp)

    def ms(sc, m):
        return 1.0 if sc <= 1 else 0.1 * m * math.log(sc) + 1.0

    scale_mult = 1.0
    if rp.get("mscale_all_dim"):
        scale_mult = ms(factor, rp["mscale_all_dim"]) ** 2
    return inv, scale_mult


def mlp(W, p, x):
    g = x @ W[p + "gate_proj.weight"].T
    u = x @ W[p + "up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ W[p + "down_proj.weight"].T


def moe(W, p, x, cfg):
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    G, TG = cfg["n_group"], cfg["topk_group"]
    s = torch.sigmoid(x @ W[p + "gate.weight"].T)
    b = s + W[p + "gate.e_score_correction_bias"]
    gs = b.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter(1, gs.topk(TG, dim=-1)[1], True)
    keep = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    idx = b.masked_fill(~keep, float("-inf")).topk(k, dim=-1)[1]
    w = s.gather(1, idx)
    if cfg["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg["routed_scaling_factor"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(idx[t, j])
            out[t] += w[t, j] * mlp(W, f"{p}experts.{e}.", x[t:t + 1])[0]
    return out + mlp(W, p + "shared_experts.", x)


def forward(W, cfg, ids):
    T = len(ids)
    H = cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r = cfg["kv_lora_rank"]
    eps = cfg["rms_norm_eps"]
    inv, mult = inv_freq_of(cfg)
    ang = torch.arange(T, dtype=DT)[:, None] * inv[None, :]  # [T, dr/2]
    scaling = (dn + dr) ** -0.5 * mult
    is_glm = cfg["model_type"] == "glm_moe_dsa"
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    h = W["model.embed_tokens.weight"][torch.tensor(ids)]
    prev_sel = None
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        x = rms(h, W[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        if cfg.get("q_lora_rank"):
            cq = rms(x @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"], 1e-6)
            q = cq @ W[a + "q_b_proj.weight"].T
        else:
            q = x @ W[a + "q_proj.weight"].T
        q = q.view(T, H, dn + dr)
        q = torch.cat([q[..., :dn], rope_pairs(q[..., dn:], ang[:, None, :])], -1)
        ckv = x @ W[a + "kv_a_proj_with_mqa.weight"].T
        c = rms(ckv[:, :r], W[a + "kv_a_layernorm.weight"], 1e-6)
        kpe = rope_pairs(ckv[:, r:], ang)
        kv = (c @ W[a + "kv_b_proj.weight"].T).view(T, H, dn + dv)
        k = torch.cat([kv[..., :dn], kpe[:, None, :].expand(T, H, dr)], -1)
        v = kv[..., dn:]
        allowed = causal.clone()
        if is_glm:
            if cfg["indexer_types"][l] == "full":
                ix = a + "indexer."
                nh, hd = cfg["index_n_heads"], cfg["index_head_dim"]
                qi = (cq @ W[ix + "wq_b.weight"].T).view(T, nh, hd)
                ki = x @ W[ix + "wk.weight"].T
                ki = torch.nn.functional.layer_norm(ki, (hd,), W[ix + "k_norm.weight"], W[ix + "k_norm.bias"], 1e-6)
                qi = torch.cat([rope_pairs(qi[..., :dr], ang[:, None, :]), qi[..., dr:]], -1)
                ki = torch.cat([rope_pairs(ki[..., :dr], ang), ki[..., dr:]], -1)
                sc = torch.relu(torch.einsum("shd,td->sht", qi, ki) * hd ** -0.5)
                wts = (x @ W[ix + "weights_proj.weight"].T) * nh ** -0.5
                I = torch.einsum("sh,sht->st", wts, sc).masked_fill(~causal, float("-inf"))
                sel = torch.zeros(T, T, dtype=torch.bool)
                for s_ in range(T):
                    kk = min(cfg["index_topk"], s_ + 1)
                    sel[s_, I[s_].topk(kk).indices] = True
                prev_sel = sel
            allowed = allowed & prev_sel
        att = torch.einsum("shd,thd->hst", q, k) * scaling
        att = att.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        o = torch.einsum("hst,thd->shd", att, v).reshape(T, H * dv)
        h = h + o @ W[a + "o_proj.weight"].T
        x = rms(h, W[p + "post_attention_layernorm.weight"], eps)
        dense = l < cfg["first_k_dense_replace"]
        h = h + (mlp(W, p + "mlp.", x) if dense else moe(W, p + "mlp.", x, cfg))
    h = rms(h, W["model.norm.weight"], eps)
    return h @ W["lm_head.weight"].T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent / "tests/data/parity"))
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    worst = 0.0
    for d in sorted(Path(args.root).iterdir()):
        if args.only and d.name not in args.only.split(","):
            continue
        cfg = json.load(open(d / "model/config.json"))
        meta = json.load(open(d / "golden/meta.json"))
        W = load_tensors(d / "model")
        for ids, fn in ((meta["prompt_ids"] + meta["tf_ids"], "logits.npy"),
                        (meta["prompt_ids"] + meta["greedy_ids"], "greedy_logits.npy")):
            gold = torch.from_numpy(np.load(d / "golden" / fn)).to(DT)
            ours = forward(W, cfg, ids)
            diff = float((ours - gold).abs().max())
            same = bool((ours.argmax(-1) == gold.argmax(-1)).all())
            worst = max(worst, diff)
            print(f"{d.name:6} {fn:18} max|diff| {diff:.3e}  argmax equal: {same}")
    print(f"worst {worst:.3e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
