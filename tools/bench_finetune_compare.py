#!/usr/bin/python3
"""The book's fine-tuning recipes in PyTorch, timed: what qkv_finetune_bench compares itself with.

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 tools/bench_finetune_compare.py \
      --mode classify|lora|full [--threads N] [--steps 5] [--batch 8] [--tokens 120] [--tiny] [--autocast]

A GPT-2 124M-shaped GPTModel of the book (chapter 4; qkv_bias, no dropout), its head replaced by Linear(768, 2) as
chapter 6 does, then
  classify  everything frozen but the last block, the final norm and the head (chapter 6's recipe);
  full      everything trainable (the backward a frozen model is compared with);
  lora      appendix E's LinearWithLoRA (rank 16, alpha 16) on every Linear of the blocks, the base frozen, the head
            fully trained;
and AdamW (lr 5e-5, weight decay 0.1) steps on a batch of random token ids, the loss on the last position; with
--autocast the forward runs under torch.autocast("cpu", dtype=torch.bfloat16) (its Linear layers in bf16). Prints one
JSON line: the median step, forward and backward milliseconds, the peak RSS in MiB, and torch's thread count.
"""
import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from finetune_reference import replace_linear_with_lora  # noqa: E402
from gpt_reference import GPTModel  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["classify", "lora", "full"], required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (smoke runs)")
    parser.add_argument("--autocast", action="store_true", help="the forward under CPU autocast to bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12, "drop_rate": 0.0,
           "qkv_bias": True}
    if args.tiny:
        cfg.update(vocab_size=512, context_length=256, emb_dim=64, n_heads=4, n_layers=2)
    torch.manual_seed(123)
    model = GPTModel(cfg)
    model.out_head = torch.nn.Linear(cfg["emb_dim"], 2)
    for p in model.parameters():
        p.requires_grad = args.mode == "full"
    if args.mode == "classify":
        for p in list(model.trf_blocks[-1].parameters()) + list(model.final_norm.parameters()):
            p.requires_grad = True
    if args.mode == "lora":
        replace_linear_with_lora(model, 16, 16, skip=("out_head",))
    for p in model.out_head.parameters():
        p.requires_grad = True
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-5, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.tokens), generator=g)
    labels = torch.randint(0, 2, (args.batch,), generator=g)
    steps, forwards, backwards = [], [], []
    for i in range(args.steps + 1):  # the first step (allocating gradients and AdamW state) is not counted
        t0 = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss = torch.nn.functional.cross_entropy(model(ids)[:, -1, :].float(), labels)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i > 0:
            steps.append(t3 - t0)
            forwards.append(t1 - t0)
            backwards.append(t2 - t1)

    def median_ms(values):
        return 1000 * sorted(values)[len(values) // 2]

    print(json.dumps({"mode": args.mode, "threads": torch.get_num_threads(), "autocast": args.autocast, "step_ms": median_ms(steps),
                      "forward_ms": median_ms(forwards), "backward_ms": median_ms(backwards),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))


if __name__ == "__main__":
    main()
