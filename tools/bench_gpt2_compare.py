#!/usr/bin/python3
"""A GPT training step in qkv, PyTorch 1.13 and llm.c, side by side in one session: tokens/s, % of the machine's FMA
peak in model FLOPs (6 × the parameters a token is multiplied by — the embedding lookup tables left out — + 12 ×
layers × width × T per token, as PaLM and nanoGPT count), and peak RSS.

  /usr/bin/python3 tools/bench_gpt2_compare.py [--build build] [--steps 3] [--llmc DIR] [--configs a,b] [--profile]
                                               [--avx2] [--bf16] [--threads 1,2]

--bf16 adds qkv with --precision bf16 and PyTorch under torch.autocast("cpu", dtype=torch.bfloat16), each beside
the float32 runs, and a second table: bf16 / fp32 for qkv, and qkv bf16 / PyTorch's best (fp32 or autocast).
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from every child's environment (some machines set them, which
halves OpenBLAS on AVX-512), except under --avx2, which sets the Haswell kernels on purpose.

Configurations: GPT-2 124M (tied head, dropout 0: llm.c's CPU setting) at (B=4, T=64), (B=8, T=256) and
(B=1, T=1024), and `qkv train`'s default model (B=8, T=128, dropout 0.1). Threads: 1 and 2.
  qkv      build/bench/qkv_train_profile (OpenBLAS single-threaded, qkv's OpenMP threads), median of --steps
  PyTorch  the book's GPTModel (tools/gpt_reference.py) with torch.optim.AdamW and clip_grad_norm_, in a child
           process per setting; 2 cores are tried both ways (2 intra-op threads, or 1 with OpenBLAS on 2) and
           the better is PyTorch's figure; torch.set_flush_denormal(True), so random weights cannot slow it
  llm.c    with --llmc DIR: a checkout of karpathy/llm.c (not part of qkv; `fetch`/git clone it). The tool
           writes a random GPT-2 124M checkpoint and token files in llm.c's formats into DIR/qkv-bench/, builds
           train_gpt2.c with llm.c's flags and fewer steps (no sampling), and takes the median step time at
           its fixed B=4, T=64.
Each step is forward, cross-entropy, backward, gradient clipping (qkv, PyTorch) and AdamW.

--avx2 runs all three on AVX2 + FMA alone, the ISA of a Zen 3, on a machine that also has AVX-512: qkv from an
AVX2 build (--build, default build-avx2, configured and built here with -march=znver3 when it has no
qkv_train_profile), OpenBLAS's Haswell kernels for qkv and PyTorch (OPENBLAS_CORETYPE=Haswell), PyTorch's AVX2
kernels, llm.c built with -march=znver3; the FMA peak is then the AVX2 loop's. It stands in for a Zen 3's ISA, not
for its cores or caches.
"""
import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

AVX2_ENV = {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2"}
AVX2_MARCH = "-march=znver3"

CONFIGS = {
    "gpt2_124M_B4T64": (dict(vocab_size=50257, context_length=64, emb_dim=768, n_heads=12, n_layers=12, drop_rate=0.0,
                             qkv_bias=False), 4, True),
    "gpt2_124M_B8T256": (dict(vocab_size=50257, context_length=256, emb_dim=768, n_heads=12, n_layers=12,
                              drop_rate=0.0, qkv_bias=False), 8, True),
    "gpt2_124M_B1T1024": (dict(vocab_size=50257, context_length=1024, emb_dim=768, n_heads=12, n_layers=12,
                               drop_rate=0.0, qkv_bias=False), 1, True),
    "qkv_train_default_B8T128": (dict(vocab_size=50257, context_length=128, emb_dim=192, n_heads=6, n_layers=4,
                                      drop_rate=0.1, qkv_bias=False), 8, False),
}


def torch_worker(args):
    """Runs in a child process: one PyTorch setting, prints a JSON line."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt_reference import GPTModel
    cfg, batch, tied = CONFIGS[args.config]
    torch.set_num_threads(args.torch_threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    if tied:
        model.out_head.weight = model.tok_emb.weight
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    T = cfg["context_length"]
    ids = torch.randint(0, cfg["vocab_size"], (batch, T))
    targets = torch.randint(0, cfg["vocab_size"], (batch, T))

    def step():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"seconds": statistics.median(times), "params": params,
                      "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def child_env(avx2, **extra):
    """The environment of a measured child: OpenBLAS left to choose its kernels for the CPU, unless --avx2."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env.update(extra)
    if avx2:
        env.update(AVX2_ENV)
    return env


def run_torch(config, torch_threads, blas_threads, steps, avx2, autocast=False):
    env = child_env(avx2, OMP_NUM_THREADS=str(blas_threads), OPENBLAS_NUM_THREADS=str(blas_threads),
                    MKL_NUM_THREADS=str(blas_threads))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker", "--config", config,
                          "--torch-threads", str(torch_threads), "--steps", str(steps)] +
                         (["--autocast"] if autocast else []),
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def build_qkv_avx2(build):
    """Configures and builds qkv_train_profile for AVX2 alone in `build`, unless it is there."""
    if os.path.exists(os.path.join(build, "bench", "qkv_train_profile")):
        return
    source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DQKV_NATIVE=OFF",
                    f"-DCMAKE_CXX_FLAGS={AVX2_MARCH}"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build, "-j", str(os.cpu_count() or 1), "--target", "qkv_train_profile"],
                   check=True, stdout=subprocess.DEVNULL)


def run_qkv(build, config, threads, steps, avx2, precision="fp32"):
    cfg, batch, tied = CONFIGS[config]
    cmd = [os.path.join(build, "bench", "qkv_train_profile"), "--vocab", str(cfg["vocab_size"]),
           "--context", str(cfg["context_length"]), "--emb", str(cfg["emb_dim"]), "--heads", str(cfg["n_heads"]),
           "--layers", str(cfg["n_layers"]), "--batch", str(batch), "--steps", str(steps), "--threads", str(threads),
           "--drop", str(cfg["drop_rate"]), "--precision", precision] + (["--tied"] if tied else [])
    env = child_env(avx2, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    if avx2 and not result.get("attention_isa", "").startswith("avx2"):
        sys.exit(f"--avx2: {cmd[0]} runs {result.get('attention_isa')} attention kernels; point --build at a build "
                 f"configured with -DQKV_NATIVE=OFF -DCMAKE_CXX_FLAGS={AVX2_MARCH} (or leave --build out)")
    profile = out.split("\n\n", 1)[1].split("RESULT", 1)[0] if "\n\n" in out else ""
    return result, profile


# ---- llm.c ----

def write_llmc_inputs(directory):
    import numpy as np
    os.makedirs(os.path.join(directory, "dev/data/tinyshakespeare"), exist_ok=True)
    maxT, V, L, NH, C, Vp = 1024, 50257, 12, 12, 768, 50304
    header = np.zeros(256, dtype=np.int32)
    header[:8] = [20240326, 3, maxT, V, L, NH, C, Vp]
    sizes = [Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C,
             L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
    rng = np.random.default_rng(0)
    with open(os.path.join(directory, "gpt2_124M.bin"), "wb") as f:
        f.write(header.tobytes())
        for i, n in enumerate(sizes):
            if i in (2, 8, 14):  # layer-norm scales
                f.write(np.ones(n, dtype=np.float32).tobytes())
            elif i in (3, 5, 7, 9, 11, 13, 15):  # biases
                f.write(np.zeros(n, dtype=np.float32).tobytes())
            else:  # GPT-2's initialisation scale
                f.write((rng.standard_normal(n, dtype=np.float32) * 0.02).tobytes())
    for name, count in (("train", 200_000), ("val", 20_000)):
        tokens = rng.integers(0, V, count, dtype=np.uint16)
        h = np.zeros(256, dtype=np.int32)
        h[:3] = [20240520, 1, count]
        with open(os.path.join(directory, f"dev/data/tinyshakespeare/tiny_shakespeare_{name}.bin"), "wb") as f:
            f.write(h.tobytes())
            f.write(tokens.tobytes())


def build_llmc(llmc, steps, avx2):
    work = os.path.join(llmc, "qkv-bench")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(llmc, "train_gpt2.c")) as f:
        source = f.read()
    # Fewer steps, no validation or sampling in the timed loop (they are outside the per-step timer anyway).
    source = source.replace("for (int step = 0; step <= 40; step++)", f"for (int step = 0; step <= {steps}; step++)")
    source = source.replace("if (step % 10 == 0) {", "if (0) {").replace("if (step > 0 && step % 20 == 0) {", "if (0) {")
    patched = os.path.join(llmc, "train_gpt2_qkvbench.c")
    with open(patched, "w") as f:
        f.write(source)
    binary = os.path.join(work, "train_gpt2_avx2" if avx2 else "train_gpt2")
    subprocess.run(["gcc", "-Ofast", "-Wno-unused-result", "-Wno-ignored-pragmas", "-Wno-unknown-attributes",
                    AVX2_MARCH if avx2 else "-march=native", "-fopenmp", "-DOMP", "-I", llmc, patched, "-lm", "-o", binary], check=True)
    if not os.path.exists(os.path.join(work, "gpt2_124M.bin")):
        write_llmc_inputs(work)
    return binary, work


def run_llmc(binary, work, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "RSS %M", binary], cwd=work, env=env, capture_output=True, text=True)
    times = [float(m) / 1000 for m in re.findall(r"took ([0-9.]+) ms", proc.stdout)][1:]  # the first step warms up
    rss = re.search(r"RSS (\d+)", proc.stderr)
    if not times:
        raise RuntimeError("llm.c printed no steps:\n" + proc.stdout[-2000:] + proc.stderr[-2000:])
    return {"seconds": statistics.median(times), "rss_mib": int(rss.group(1)) / 1024 if rss else float("nan"),
            "wall": time.perf_counter() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", help="qkv's build directory (default build, or build-avx2 with --avx2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--llmc", help="a checkout of karpathy/llm.c")
    parser.add_argument("--profile", action="store_true", help="also print qkv's per-op profile of each setting")
    parser.add_argument("--avx2", action="store_true", help="every library on AVX2 + FMA alone (a Zen 3's ISA)")
    parser.add_argument("--bf16", action="store_true", help="also qkv --precision bf16 and PyTorch's CPU autocast")
    parser.add_argument("--threads", default="1,2", help="thread counts to measure (default 1,2)")
    parser.add_argument("--autocast", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--torch-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        torch_worker(args)
        return
    if args.build is None:
        args.build = "build-avx2" if args.avx2 else "build"
        if args.avx2:
            build_qkv_avx2(args.build)
    llmc = build_llmc(args.llmc, args.steps + 1, args.avx2) if args.llmc else None
    rows = []
    for config in args.configs.split(","):
        cfg, batch, _ = CONFIGS[config]
        tokens = batch * cfg["context_length"]
        for threads in [int(t) for t in args.threads.split(",")]:
            q, profile = run_qkv(args.build, config, threads, args.steps, args.avx2)
            fpt = q["flops_per_token"]
            peak = q["peak_gflops"]
            settings = [(1, 1)] if threads == 1 else [(2, 1), (1, 2)]
            t_runs = [run_torch(config, a, b, args.steps, args.avx2) for a, b in settings]
            t_best = min(t_runs, key=lambda r: r["seconds"])
            t_tps = tokens / t_best["seconds"]
            row = {"config": config, "threads": threads, "qkv_tps": q["tokens_per_second"],
                   "qkv_peak": 100 * q["gflops"] / peak, "gemm_peak": 100 * q.get("gemm_gflops", 0) / peak,
                   "qkv_rss": q["rss_mib"], "torch_tps": t_tps,
                   "torch_all": [tokens / r["seconds"] for r in t_runs],
                   "torch_peak": 100 * fpt * t_tps / 1e9 / peak, "torch_rss": t_best["rss_mib"], "peak": peak}
            if args.bf16:
                qb, _ = run_qkv(args.build, config, threads, args.steps, args.avx2, "bf16")
                a_runs = [run_torch(config, a, b, args.steps, args.avx2, autocast=True) for a, b in settings]
                a_best = min(a_runs, key=lambda r: r["seconds"])
                row.update(qkv_bf16_tps=qb["tokens_per_second"], qkv_bf16_rss=qb["rss_mib"],
                           bf16_peak=qb.get("bf16_peak_gflops", 0), qkv_bf16_gflops=qb["gflops"],
                           torch_autocast_tps=tokens / a_best["seconds"], torch_autocast_rss=a_best["rss_mib"])
            if llmc and config == "gpt2_124M_B4T64":
                l = run_llmc(*llmc, threads)
                row["llmc_tps"] = tokens / l["seconds"]
                row["llmc_rss"] = l["rss_mib"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.profile:
                print(profile, flush=True)
    print("\n| configuration | threads | qkv tok/s | % of FMA peak | its GEMMs alone | peak RSS | PyTorch 1.13 tok/s | "
          "% peak | peak RSS | qkv / PyTorch | at most | llm.c tok/s | qkv / llm.c |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    def bound(r):  # qkv / PyTorch if qkv's step took only its GEMMs' time alone: PyTorch runs the same BLAS
        return f"{r['gemm_peak'] / r['torch_peak']:.2f}×" if r["gemm_peak"] > 0 else ""

    for r in rows:
        llmc_cells = (f"{r['llmc_tps']:.1f} | {r['qkv_tps'] / r['llmc_tps']:.1f}×" if "llmc_tps" in r else " | ")
        torch_note = "" if r["threads"] == 1 else " (best of " + " / ".join(f"{v:.1f}" for v in r["torch_all"]) + ")"
        print(f"| {r['config']} | {r['threads']} | {r['qkv_tps']:.1f} | {r['qkv_peak']:.1f}% | {r['gemm_peak']:.1f}% | "
              f"{r['qkv_rss']:.0f} MiB | "
              f"{r['torch_tps']:.1f}{torch_note} | {r['torch_peak']:.1f}% | {r['torch_rss']:.0f} MiB | "
              f"{r['qkv_tps'] / r['torch_tps']:.2f}× | {bound(r)} | {llmc_cells} |")
    if args.bf16:
        print("\n| configuration | threads | qkv fp32 tok/s | qkv bf16 tok/s | bf16 / fp32 | % of bf16 peak | peak RSS | "
              "PyTorch fp32 | PyTorch autocast | qkv bf16 / PyTorch's best |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            best = max(r["torch_tps"], r["torch_autocast_tps"])
            bf16_peak = f"{100 * r['qkv_bf16_gflops'] / r['bf16_peak']:.1f}%" if r["bf16_peak"] > 0 else ""
            print(f"| {r['config']} | {r['threads']} | {r['qkv_tps']:.1f} | {r['qkv_bf16_tps']:.1f} | "
                  f"{r['qkv_bf16_tps'] / r['qkv_tps']:.2f}× | {bf16_peak} | {r['qkv_bf16_rss']:.0f} MiB | "
                  f"{r['torch_tps']:.1f} | {r['torch_autocast_tps']:.1f} | {r['qkv_bf16_tps'] / best:.2f}× |")
    isa = ("AVX2 + FMA alone (--avx2: qkv's AVX2 build, OpenBLAS's Haswell kernels, PyTorch's AVX2 kernels); the "
           "AVX2 FMA loop" if args.avx2 else "the faster of AVX2 and AVX-512 FMA loops")
    peaks = ", ".join(f"{r['peak']:.0f} GFLOP/s on {r['threads']} thread{'s' if r['threads'] > 1 else ''}"
                      for r in {r['threads']: r for r in rows}.values())
    print(f"\nFMA peak measured by qkv_train_profile: {peaks} "
          f"({isa}); model FLOPs per token = 6N + 12·L·C·T, N without the lookup tables. \"Its GEMMs alone\": "
          f"the step's matrix products timed on their own (qkv_train_profile), the most a step could reach here; \"at most\": "
          f"qkv / PyTorch if qkv's step took only that time (PyTorch's GEMMs are the same OpenBLAS's).")


if __name__ == "__main__":
    main()
