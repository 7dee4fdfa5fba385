#!/usr/bin/python3
"""A GPT-2 model.safetensors of a given size with random weights, under Hugging Face's names, for measuring qkv
at GPT-2's shape where the real weights cannot be downloaded (no network here). Not for generating text.

  /usr/bin/python3 tools/make_gpt2_shaped.py OUT.safetensors [--layers 12 --emb 768 --heads 12 --ctx 1024]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from torch_reference import save_safetensors  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--emb", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    a = p.parse_args()
    torch.manual_seed(0)
    C = a.emb
    t = {"wte.weight": torch.randn(a.vocab, C) * 0.02, "wpe.weight": torch.randn(a.ctx, C) * 0.01,
         "ln_f.weight": torch.ones(C), "ln_f.bias": torch.zeros(C)}
    for i in range(a.layers):
        h = f"h.{i}."
        t.update({h + "ln_1.weight": torch.ones(C), h + "ln_1.bias": torch.zeros(C),
                  h + "attn.c_attn.weight": torch.randn(C, 3 * C) * 0.02, h + "attn.c_attn.bias": torch.zeros(3 * C),
                  h + "attn.c_proj.weight": torch.randn(C, C) * 0.02, h + "attn.c_proj.bias": torch.zeros(C),
                  h + "ln_2.weight": torch.ones(C), h + "ln_2.bias": torch.zeros(C),
                  h + "mlp.c_fc.weight": torch.randn(C, 4 * C) * 0.02, h + "mlp.c_fc.bias": torch.zeros(4 * C),
                  h + "mlp.c_proj.weight": torch.randn(4 * C, C) * 0.02, h + "mlp.c_proj.bias": torch.zeros(C)})
    save_safetensors(a.out, t, {"n_head": str(a.heads)})


if __name__ == "__main__":
    main()
