#!/usr/bin/python3
"""A real-text classification task from a Debian package: King James verses labelled by testament.

  tools/kjv_testament.py --out DIR [--train 800] [--val 100] [--test 200] [--seed 1] [--min-words 8]

Reads the Bible from Debian's bible-kjv (the `bible` program), keeps verses of at least --min-words words, draws the
same number of Old and New Testament verses for each split (no verse in two splits) with Python's random.Random(seed),
and writes DIR/train.csv, DIR/val.csv and DIR/test.csv in the book's layout (a header "Label,Text"; labels OT, NT).
"""
import argparse
import csv
import os
import random
import re
import subprocess


def verses(reference):
    text = subprocess.run(["bible", "-l", "0", reference], check=True, capture_output=True, text=True).stdout
    return [m.group(1).strip() for m in re.finditer(r"^\s+\d+ (.+)$", text, re.M)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=800, help="verses per testament")
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-words", type=int, default=8)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pools = {}
    for label, reference in (("OT", "gen1:1-mal4:6"), ("NT", "mat1:1-rev22:21")):
        pool = [v for v in verses(reference) if len(v.split()) >= args.min_words]
        rng.shuffle(pool)
        pools[label] = pool
    need = args.train + args.val + args.test
    for label, pool in pools.items():
        if len(pool) < need:
            raise SystemExit(f"{label}: {len(pool)} verses of {args.min_words}+ words, fewer than the {need} asked for")
    os.makedirs(args.out, exist_ok=True)
    start = 0
    for split, n in (("train", args.train), ("val", args.val), ("test", args.test)):
        rows = [(label, text) for label, pool in pools.items() for text in pool[start:start + n]]
        rng.shuffle(rows)
        with open(os.path.join(args.out, split + ".csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["Label", "Text"])
            writer.writerows(rows)
        start += n
    print(f"wrote {args.out}/train.csv, val.csv, test.csv ({args.train}/{args.val}/{args.test} verses per testament)")


if __name__ == "__main__":
    main()
