#!/usr/bin/python3
"""The book's attention classes in PyTorch, and the fixtures the C++ tests compare against.

Run with Debian's python3-torch:  /usr/bin/python3 tools/torch_reference.py [--out tests/fixtures]
It writes small safetensors files; the tests read them without torch. Re-running gives the same files.
Not here: benchmarks (tools/bench_torch.py).
"""
import argparse
import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn as nn


# ---- the book's classes (Raschka, Build a Large Language Model (from Scratch), chapter 3) ----

class SelfAttention_v1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class SelfAttention_v2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class MultiHeadAttentionWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)])

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        self.last_weights = attn_weights.detach()  # kept for the attention-map fixtures (before dropout)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


MODULES = {
    "SelfAttention_v1": (SelfAttention_v1, ["d_in", "d_out"]),
    "SelfAttention_v2": (SelfAttention_v2, ["d_in", "d_out", "qkv_bias"]),
    "CausalAttention": (CausalAttention, ["d_in", "d_out", "context_length", "dropout", "qkv_bias"]),
    "MultiHeadAttentionWrapper": (MultiHeadAttentionWrapper,
                                  ["d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias"]),
    "MultiHeadAttention": (MultiHeadAttention,
                           ["d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias"]),
}


# ---- safetensors, written by hand (the safetensors package is not in Debian 12) ----

_DTYPES = {np.float32: "F32", np.float64: "F64", np.int64: "I64", np.int32: "I32", np.float16: "F16", np.uint8: "U8"}


def save_safetensors(path, tensors, metadata=None):
    """tensors: ordered dict name -> numpy array or torch tensor; metadata: dict of strings."""
    header = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous().numpy()
        array = np.ascontiguousarray(value)
        dtype = _DTYPES[array.dtype.type]
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def module_metadata(kind, args):
    meta = {"module": kind}
    for key in MODULES[kind][1]:
        value = args[key]
        meta[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return meta


def build_module(kind, args, seed):
    cls, names = MODULES[kind]
    torch.manual_seed(seed)
    return cls(*[args[n] for n in names])


def run_case(module, x, grad_output, train, seed):
    """Forward (dropout drawn after torch.manual_seed(seed)) and backward of <output, grad_output>."""
    module.train(train)
    x = x.clone().requires_grad_(True)
    module.zero_grad()
    torch.manual_seed(seed)
    out = module(x)
    out.backward(grad_output)
    result = {"output": out.detach()}
    result["grad.input"] = x.grad
    for name, p in module.named_parameters():
        result["grad." + name] = p.grad
    return result


# ---- fixtures ----

def rng_fixtures(out_dir):
    tensors = {}
    for seed in [0, 123, 789, 2 ** 40 + 5]:
        for n in [1, 5, 16, 37]:
            torch.manual_seed(seed)
            tensors[f"rand.{seed}.{n}"] = torch.rand(n)
        for n in [1, 7, 15, 16, 17, 37, 100, 1000]:
            torch.manual_seed(seed)
            tensors[f"randn.{seed}.{n}"] = torch.randn(n)
        torch.manual_seed(seed)
        first, second = torch.randn(3), torch.randn(3)  # the Box-Muller cache carries across calls
        tensors[f"randn_pair.{seed}"] = torch.cat([first, second])
        torch.manual_seed(seed)
        tensors[f"rand_range.{seed}"] = torch.empty(20).uniform_(-2.5, 0.75)
        torch.manual_seed(seed)
        linear = nn.Linear(5, 3)
        tensors[f"linear.{seed}.weight"] = linear.weight
        tensors[f"linear.{seed}.bias"] = linear.bias
        torch.manual_seed(seed)
        wide = nn.Linear(768, 24)
        tensors[f"linear_wide.{seed}.weight"] = wide.weight
        tensors[f"linear_wide.{seed}.bias"] = wide.bias
        torch.manual_seed(seed)
        tensors[f"embedding.{seed}"] = nn.Embedding(10, 4).weight
        torch.manual_seed(seed)
        tensors[f"embedding_small.{seed}"] = nn.Embedding(3, 4).weight
        torch.manual_seed(seed)
        tensors[f"dropout.{seed}"] = nn.Dropout(0.5)(torch.ones(6, 6))
        torch.manual_seed(seed)
        tensors[f"dropout_p01.{seed}"] = nn.Dropout(0.1)(torch.ones(3, 50))
    save_safetensors(os.path.join(out_dir, "rng.safetensors"), tensors)


def module_cases():
    """(name, kind, args, batch, T, train, seed) — the odd shapes the issues ask for, and ordinary ones."""
    cases = []

    def add(name, kind, batch, T, train=False, **args):
        cases.append((name, kind, args, batch, T, train))

    add("v1_book", "SelfAttention_v1", None, 6, d_in=3, d_out=2)
    add("v1_batched", "SelfAttention_v1", 2, 5, d_in=4, d_out=3)
    add("v2_book", "SelfAttention_v2", None, 6, d_in=3, d_out=2, qkv_bias=False)
    add("v2_bias_t1", "SelfAttention_v2", None, 1, d_in=5, d_out=4, qkv_bias=True)
    add("v2_batched_t37", "SelfAttention_v2", 3, 37, d_in=6, d_out=5, qkv_bias=True)
    add("causal_book", "CausalAttention", 2, 6, d_in=3, d_out=2, context_length=6, dropout=0.0, qkv_bias=False)
    add("causal_t1", "CausalAttention", 1, 1, d_in=4, d_out=3, context_length=4, dropout=0.0, qkv_bias=True)
    add("causal_t37_short", "CausalAttention", 2, 37, d_in=5, d_out=4, context_length=40, dropout=0.0, qkv_bias=False)
    add("causal_dropout", "CausalAttention", 2, 6, True, d_in=3, d_out=2, context_length=6, dropout=0.5,
        qkv_bias=False)
    add("wrapper_book", "MultiHeadAttentionWrapper", 2, 6, d_in=3, d_out=2, context_length=6, dropout=0.0,
        num_heads=2, qkv_bias=False)
    add("wrapper_bias_batch5", "MultiHeadAttentionWrapper", 5, 7, d_in=4, d_out=3, context_length=8,
        dropout=0.0, num_heads=3, qkv_bias=True)
    add("wrapper_dropout", "MultiHeadAttentionWrapper", 2, 9, True, d_in=4, d_out=2, context_length=9,
        dropout=0.3, num_heads=2, qkv_bias=False)
    add("mha_book", "MultiHeadAttention", 2, 6, d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2,
        qkv_bias=False)
    add("mha_6_by_3", "MultiHeadAttention", 5, 11, d_in=4, d_out=6, context_length=12, dropout=0.0, num_heads=3,
        qkv_bias=True)
    add("mha_t1", "MultiHeadAttention", 1, 1, d_in=8, d_out=8, context_length=4, dropout=0.0, num_heads=2,
        qkv_bias=False)
    add("mha_t37", "MultiHeadAttention", 2, 37, d_in=8, d_out=12, context_length=37, dropout=0.0, num_heads=4,
        qkv_bias=True)
    add("mha_dropout", "MultiHeadAttention", 3, 10, True, d_in=6, d_out=6, context_length=10, dropout=0.2,
        num_heads=3, qkv_bias=True)
    return cases


def module_fixtures(out_dir):
    directory = os.path.join(out_dir, "modules")
    os.makedirs(directory, exist_ok=True)
    manifest = []
    for index, (name, kind, args, batch, T, train) in enumerate(module_cases()):
        module = build_module(kind, args, seed=1000 + index)
        generator = torch.Generator().manual_seed(5000 + index)
        shape = (T, args["d_in"]) if batch is None else (batch, T, args["d_in"])
        x = torch.randn(shape, generator=generator)
        with torch.no_grad():
            probe = module.eval()(x)
        grad_output = torch.randn(probe.shape, generator=generator)
        seed = 77 + index
        expected = run_case(module, x, grad_output, train, seed)
        save_safetensors(os.path.join(directory, f"{name}.module.safetensors"), module.state_dict(),
                         module_metadata(kind, args))
        save_safetensors(os.path.join(directory, f"{name}.input.safetensors"),
                         {"input": x, "grad_output": grad_output})
        save_safetensors(os.path.join(directory, f"{name}.expected.safetensors"), expected,
                         {"train": "true" if train else "false", "seed": str(seed)})
        manifest.append(name)
    with open(os.path.join(directory, "cases.txt"), "w") as f:
        f.write("\n".join(manifest) + "\n")


def optim_fixtures(out_dir):
    """Parameters after each of 5 steps with fixed gradients, for SGD and AdamW with several settings."""
    generator = torch.Generator().manual_seed(42)
    start = torch.randn(4, 3, generator=generator)
    grads = torch.randn(5, 4, 3, generator=generator)
    tensors = {"start": start, "grads": grads}
    settings = {
        "sgd_plain": lambda p: torch.optim.SGD([p], lr=0.1),
        "sgd_momentum": lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
        "sgd_nesterov": lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.8, nesterov=True),
        "adamw_default": lambda p: torch.optim.AdamW([p]),
        "adamw_custom": lambda p: torch.optim.AdamW([p], lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    }
    for name, make in settings.items():
        p = start.clone().requires_grad_(True)
        optimizer = make(p)
        trajectory = []
        for step in range(5):
            p.grad = grads[step].clone()
            optimizer.step()
            trajectory.append(p.detach().clone())
        tensors[name] = torch.stack(trajectory)
    save_safetensors(os.path.join(out_dir, "optim.safetensors"), tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng_fixtures(args.out)
    module_fixtures(args.out)
    optim_fixtures(args.out)
    print(f"fixtures written to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
