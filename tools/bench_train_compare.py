#!/usr/bin/python3
"""Training throughput (tokens/s) of qkv next to PyTorch 1.13, in one session, same configurations and threads.

  /usr/bin/python3 tools/bench_train_compare.py [--build build] [--repeats 5]

Configurations: `qkv train`'s default (vocab 50257, context 128, emb 192, 6 heads, 4 layers, batch 8) and
GPT-2's shape (emb 768, 12 heads, 12 layers, T = 256, batch 2); one step = forward, cross-entropy, backward,
gradient clipping, AdamW. PyTorch runs the book's GPTModel (tools/gpt_reference.py). Also prints the KV-cache
generation speed-up measured by qkv_model_bench.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpt_reference import GPTModel  # noqa: E402

CONFIGS = {
    "default_config_B8T128": ({"vocab_size": 50257, "context_length": 128, "emb_dim": 192, "n_heads": 6, "n_layers": 4,
                               "drop_rate": 0.1, "qkv_bias": False}, 8),
    "gpt2_124M_B2T256": ({"vocab_size": 50257, "context_length": 256, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
                          "drop_rate": 0.1, "qkv_bias": False}, 2),
}


def torch_tokens_per_second(cfg, batch, threads, repeats):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    T = cfg["context_length"]
    ids = torch.randint(0, cfg["vocab_size"], (batch, T))
    targets = torch.randint(0, cfg["vocab_size"], (batch, T))

    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return batch * T / statistics.median(times)


def qkv_results(build, repeats):
    command = [os.path.join(build, "bench", "qkv_model_bench"), "--benchmark_format=json",
               f"--benchmark_repetitions={repeats}", "--benchmark_report_aggregates_only=true"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    data = json.loads(out[out.index("{"):])
    results = {}
    for b in data["benchmarks"]:
        name = b["run_name"].split("/iterations")[0].split("/repeats")[0].split("/real_time")[0]
        if b.get("aggregate_name", "median") == "median":  # single-run benchmarks have no aggregate
            results[name] = b
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    qkv = qkv_results(args.build, 3)
    print(f"{'training step':40} {'torch tok/s':>12} {'qkv tok/s':>12} {'speed-up':>9}")
    for name, (cfg, batch) in CONFIGS.items():
        for threads in (1, 2):
            key = f"train_step/{name}/threads:{threads}"
            t = torch_tokens_per_second(cfg, batch, threads, args.repeats)
            q = qkv.get(key, {}).get("tokens/s", float("nan"))
            print(f"{key:40} {t:12.0f} {q:12.0f} {q / t:8.2f}x")
    cached = qkv.get("generate_256/gpt2_124M/kv_cache/threads:2", {}).get("tokens/s", float("nan"))
    uncached = qkv.get("generate_256/gpt2_124M/no_cache/threads:2", {}).get("tokens/s", float("nan"))
    print(f"generation, 256 new tokens, GPT-2 124M shape: {cached:.1f} tok/s with the KV cache, "
          f"{uncached:.1f} without: {cached / uncached:.1f}x")
    tokenize = qkv.get("tokenize_gpt2/1MB", {}).get("MB/s", float("nan"))
    print(f"GPT-2 tokenizer: {tokenize:.2f} MB/s")


if __name__ == "__main__":
    main()
