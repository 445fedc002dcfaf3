#!/usr/bin/env python3
"""Times training steps of tools/train_tiny_glm5.py's model: one step of a batch of random ids with
the indexer KL loss, through a transformers experts implementation, with or without bf16 autocast.

Usage: python tools/train_step_bench.py {eager|grouped_mm|batched_mm} {fp32|bf16} [batch] [steps]
Prints each step's seconds and tokens/s (the first includes warm-up). Needs tools/requirements-train.txt.
"""
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_tiny_glm5 as kjv  # noqa: E402


def main():
    impl, amp = sys.argv[1], sys.argv[2] == "bf16"
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    torch.set_num_threads(2)

    class Args:
        out = kjv.DEFAULT_OUT

    config = kjv.make_config(kjv.load_tokenizer(Args))
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM._from_config(config, attn_implementation="eager", experts_implementation=impl,
                                              dtype=torch.float32)
    model.train()
    probe = kjv.IndexerProbe(model, config.index_topk, "train")
    x = torch.randint(0, config.vocab_size - 16, (batch, 257))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        t0 = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(input_ids=x[:, :-1], use_cache=False)
        loss = F.cross_entropy(out.logits.float().reshape(-1, config.vocab_size), x[:, 1:].reshape(-1))
        idx_loss, _ = probe.take_loss()
        (loss + idx_loss).backward()
        opt.step()
        opt.zero_grad()
        dt = time.time() - t0
        print(f"{impl} {'bf16' if amp else 'fp32'} batch {batch}: {dt:.2f} s, {batch * 256 / dt:.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
