#!/usr/bin/env python3
"""Writes a random-weight GLM-5-architecture checkpoint (GlmMoeDsaForCausalLM: MLA, DSA indexer,
sigmoid-routed MoE) in Hugging Face format, for the peer benchmark (bench/peer_bench.sh): hidden
2048, 8 layers (layer 0 dense), 32 routed experts of 1408 plus one shared, top-8, about 2.2 B
parameters, BF16 (norms and the router's correction bias F32). The tensor names and shapes come
from transformers' model definition on the meta device (tools/make_parity_fixtures.py); values are
N(0, 0.02) (norms 1), written shard by shard so memory stays at one shard. The tokenizer is the
embedded model's (4096 ids): the benchmarks feed token ids, so only its size matters.

    python tools/make_peer_checkpoint.py OUT_DIR [--layers 8] [--seed 1]
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_parity_fixtures import checkpoint_shapes  # noqa: E402
from transformers import GlmMoeDsaConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "models" / "glm5-tiny-kjv"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    args = ap.parse_args()

    config = GlmMoeDsaConfig(
        vocab_size=4096,
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=1,
        n_routed_experts=32,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=16,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=4089,
        eos_token_id=4089,
        num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    config.architectures = ["GlmMoeDsaForCausalLM"]
    shapes = checkpoint_shapes(config, {"mtp": False, "arch": "glm"})
    args.out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, args.out / name)

    gen = torch.Generator().manual_seed(args.seed)
    limit = int(args.shard_gb * 1e9)
    shards, current, size = [], {}, 0
    names = sorted(shapes)
    for name in names:
        shape = shapes[name]
        leaf = name.split(".")[-1]
        if leaf == "e_score_correction_bias":
            t = torch.zeros(shape, dtype=torch.float32)
        elif len(shape) == 1:  # norms
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        current[name] = t
        size += t.numel() * t.element_size()
        if size >= limit:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    total = 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, args.out / file, metadata={"format": "pt"})
        for name, t in shard.items():
            index["weight_map"][name] = file
            total += t.numel() * t.element_size()
    index["metadata"]["total_size"] = total
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    params = sum(int(torch.tensor(s).prod()) if len(s) else 1 for s in shapes.values())
    print(f"{args.out}: {params / 1e9:.2f} B parameters, {total / 1e9:.2f} GB in {len(shards)} shards")


if __name__ == "__main__":
    main()
