#!/usr/bin/python3
"""qkv's fused attention next to PyTorch 1.13, measured in one session on this machine.

  /usr/bin/python3 tools/bench_compare.py [--build build] [--quick] [--repeats 5]

For every shape (B, H, T, D) of bench/attention_bench.cpp, causal and not, forward and forward+backward,
1 and 2 threads, it times
  - PyTorch: plain attention as the book writes it (Q Kᵀ, masked_fill, softmax, · V) on (B, H, T, D);
  - qkv: the fused kernel (qkv_bench, Google Benchmark, JSON output),
and the book's MultiHeadAttention module (768 → 768, 12 heads, causal, B = 4, T = 1024), forward + backward,
against qkv's MultiHeadAttention. It prints medians and the speed-up, and the peak RSS of one causal
forward+backward at (1, 8, 4096, 64) in a fresh process for each library. Last (alone with --apply-only), the
same module through `qkv apply` as a whole process (loading the module and the .npy files, writing every
gradient) against PyTorch in-process at B 4 × T 1024, and qkv apply's peak RSS at B 1 × T 4096.
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
from torch_reference import MultiHeadAttention  # noqa: E402

SHAPES = [(8, 12, 256, 64), (4, 12, 1024, 64), (1, 12, 2048, 64), (1, 8, 4096, 64)]


def median_ms(fn, repeats):
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def torch_attention(shape, causal, backward, threads, repeats):
    torch.set_num_threads(threads)
    B, H, T, D = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=backward) for _ in range(3))
    d_o = torch.randn(B, H, T, D, generator=g)
    mask = torch.triu(torch.ones(T, T), diagonal=1).bool()

    def run():
        scores = q @ k.transpose(2, 3)
        if causal:
            scores = scores.masked_fill(mask, -torch.inf)
        out = torch.softmax(scores / D ** 0.5, dim=-1) @ v
        if backward:
            out.backward(d_o)
            q.grad = k.grad = v.grad = None
        return out

    with torch.set_grad_enabled(backward):
        return median_ms(run, repeats)


def torch_mha(threads, repeats, B=4, T=1024, C=768, H=12):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    module = MultiHeadAttention(C, C, T, 0.0, H)
    x = torch.randn(B, T, C, requires_grad=True)
    grad = torch.randn(B, T, C)

    def run():
        module.zero_grad()
        module(x).backward(grad)
        x.grad = None

    return median_ms(run, repeats)


def export_mha(directory, B, T, C=768, H=12):
    """The book's MultiHeadAttention (seed 123) as qkv apply reads it, with an input and a grad_output."""
    import numpy as np
    torch.manual_seed(123)
    module = MultiHeadAttention(C, C, T, 0.0, H)
    meta = {"module": "MultiHeadAttention", "d_in": str(C), "d_out": str(C), "context_length": str(T),
            "dropout": "0.0", "num_heads": str(H), "qkv_bias": "false"}
    header, blobs, offset = {"__metadata__": meta}, [], 0
    for name, t in module.state_dict().items():
        raw = t.detach().contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    paths = {k: os.path.join(directory, f"{k}_B{B}T{T}") for k in ("module", "input", "grad")}
    paths["module"] += ".safetensors"
    with open(paths["module"], "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    for key in ("input", "grad"):
        paths[key] += ".npy"
        np.save(paths[key], torch.randn(B, T, C).numpy())
    return module, paths


def run_apply(build, paths, threads):
    """One whole `qkv apply` process (load, forward, backward, write): wall seconds and peak RSS in MiB."""
    command = [os.path.join(build, "qkv"), "apply", "--module", paths["module"], "--input", paths["input"],
               "--grad-output", paths["grad"], "--output", paths["module"] + ".out.safetensors",
               "--threads", str(threads)]
    # Linux hands a forked child its parent's peak RSS, so qkv is started from a small Python without torch
    # (a child forked from this process would report PyTorch's gigabyte as its own peak).
    launcher = ("import os, subprocess, sys, time\n"
                "start = time.perf_counter()\n"
                "child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
                "_, status, usage = os.wait4(child.pid, 0)\n"
                "print(time.perf_counter() - start, usage.ru_maxrss, status)\n")
    out = subprocess.run([sys.executable, "-c", launcher] + command, check=True, capture_output=True, text=True)
    seconds, max_kb, status = out.stdout.split()
    if status != "0":
        raise SystemExit(f"{' '.join(command)} failed: {out.stderr}")
    return float(seconds), int(max_kb) / 1024


def compare_apply(build, repeats, threads=2):
    """The book's MultiHeadAttention (768, 12 heads, causal) forward+backward: qkv apply as a whole process
    against PyTorch in-process, B 4 × T 1024; and qkv apply's peak RSS at B 1 × T 4096."""
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        module, paths = export_mha(directory, 4, 1024)
        qkv_s = statistics.median(run_apply(build, paths, threads)[0] for _ in range(repeats))
        torch.set_num_threads(threads)
        x = torch.from_numpy(__import__("numpy").load(paths["input"])).requires_grad_(True)
        grad = torch.from_numpy(__import__("numpy").load(paths["grad"]))

        def run():
            module.zero_grad()
            module(x).backward(grad)
            x.grad = None

        torch_ms = median_ms(run, repeats)
        print(f"MultiHeadAttention B4 T1024 fwd+bwd, {threads} threads: qkv apply (whole process) "
              f"{qkv_s * 1e3:.0f} ms, PyTorch in-process {torch_ms:.0f} ms: {torch_ms / (qkv_s * 1e3):.2f}x")
        _, paths = export_mha(directory, 1, 4096)
        rss = statistics.median(run_apply(build, paths, threads)[1] for _ in range(3))
        print(f"MultiHeadAttention B1 T4096 causal fwd+bwd through qkv apply: peak RSS {rss:.0f} MiB")


def qkv_results(build, quick, repeats):
    command = [os.path.join(build, "bench", "qkv_bench"), "--benchmark_format=json",
               f"--benchmark_repetitions={repeats}", "--benchmark_report_aggregates_only=true",
               "--benchmark_filter=^fused/" + ("(fwd.*B4H12T1024D64|.*MultiHead)" if quick else "")]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    data = json.loads(out[out.index("{"):])
    results = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        name = b["run_name"].split("/min_time")[0].split("/repeats")[0].split("/real_time")[0]
        results[name] = b["real_time"] if b["time_unit"] == "ms" else b["real_time"] / 1e6
    return results


def peak_rss_torch(shape):
    peak_fn = ("def peak():\n"
               "    for line in open('/proc/self/status'):\n"
               "        if line.startswith('VmHWM:'): return float(line.split()[1]) / 1024\n")
    code = peak_fn + f"""
import torch
B, H, T, D = {shape}
q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
mask = torch.triu(torch.ones(T, T), diagonal=1).bool()
s = (q @ k.transpose(2, 3)).masked_fill(mask, -torch.inf)
(torch.softmax(s / D ** 0.5, dim=-1) @ v).backward(torch.randn(B, H, T, D))
print(peak())
"""
    base = subprocess.run([sys.executable, "-c", peak_fn + "import torch\nprint(peak())"],
                          check=True, capture_output=True, text=True).stdout
    peak = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(peak), float(base)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    parser.add_argument("--quick", action="store_true", help="only (4, 12, 1024, 64) and the module")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--apply-only", action="store_true",
                        help="only the MultiHeadAttention module through `qkv apply`, as a whole process")
    args = parser.parse_args()
    if args.apply_only:
        compare_apply(args.build, args.repeats)
        return

    qkv = qkv_results(args.build, args.quick, args.repeats)
    shapes = [(4, 12, 1024, 64)] if args.quick else SHAPES
    print(f"{'benchmark':44} {'torch ms':>10} {'qkv ms':>10} {'speed-up':>9}")
    for shape in shapes:
        tag = "B{}H{}T{}D{}".format(*shape)
        for backward in (False, True):
            for causal in (False, True):
                for threads in (1, 2):
                    name = f"{'fwd+bwd' if backward else 'fwd'}/{'causal' if causal else 'full'}/{tag}/threads:{threads}"
                    t = torch_attention(shape, causal, backward, threads, args.repeats)
                    q = qkv.get("fused/" + name)
                    print(f"{name:44} {t:10.2f} {q if q else float('nan'):10.2f} {t / q if q else float('nan'):8.2f}x")
    for threads in (1, 2):
        name = f"fwd+bwd/MultiHeadAttention_B4T1024C768H12/threads:{threads}"
        t = torch_mha(threads, args.repeats)
        q = qkv.get("fused/" + name)
        print(f"{name:44} {t:10.2f} {q if q else float('nan'):10.2f} {t / q if q else float('nan'):8.2f}x")
    rss_bin = os.path.join(args.build, "bench", "qkv_attention_rss")
    print(subprocess.run([rss_bin, "1", "8", "4096", "64"], check=True, capture_output=True, text=True).stdout.strip())
    peak, base = peak_rss_torch((1, 8, 4096, 64))
    print(f"PyTorch (1,8,4096,64) causal fwd+bwd: peak RSS {peak:.1f} MiB ({base:.1f} MiB after import torch)")
    compare_apply(args.build, args.repeats)


if __name__ == "__main__":
    main()
