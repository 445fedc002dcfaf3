#!/usr/bin/env python3
"""Writes an FP8 copy of a Hugging Face checkpoint in the DeepSeek-V3 / GLM-5 FP8 format: every
2-D Linear weight (attention, indexer, MLPs, shared and routed experts, lm_head; not the
embeddings, norms or the router) as float8_e4m3fn in blocks of 128 x 128 with a float32
`<name>_scale_inv` per block (block amax / 448, each weight rounded to the nearest E4M3), and
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]} in
config.json. Other tensors and files are copied as they are. For benchmarks of FP8 weights kept
as stored (bench/RESULTS.md, "FP8 weights").

    python tools/make_fp8_checkpoint.py IN_DIR OUT_DIR [--block 128]
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E4M3_MAX = 448.0


def is_fp8_weight(name, tensor):
    return (tensor.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name
            and not name.endswith("mlp.gate.weight"))


def quantize(w, block):
    rows, cols = w.shape
    br, bc = (rows + block - 1) // block, (cols + block - 1) // block
    padded = torch.zeros(br * block, bc * block, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(br, block, bc, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(br * block, bc * block)[:rows, :cols].contiguous(), scale.contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it first")
    args.out.mkdir(parents=True)

    shards = sorted(args.source.glob("*.safetensors"))
    weight_map = {}
    for shard in shards:
        tensors = {}
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if is_fp8_weight(name, t):
                    tensors[name], tensors[name + "_scale_inv"] = quantize(t, args.block)
                    weight_map[name + "_scale_inv"] = shard.name
                else:
                    tensors[name] = t
                weight_map[name] = shard.name
        save_file(tensors, args.out / shard.name, metadata={"format": "pt"})
        print(f"{shard.name}: {len(tensors)} tensors")

    for path in args.source.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, args.out / path.name)
    config = json.loads((args.source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": [args.block, args.block]}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (args.source / "model.safetensors.index.json").exists():
        index = json.loads((args.source / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


if __name__ == "__main__":
    main()
