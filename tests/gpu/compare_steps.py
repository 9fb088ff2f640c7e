#!/usr/bin/env python3
"""Compare two steps files written by torch_program.py, step by step.

Each line is `<step> <loss hex> <bulk checksum hex>`. Lines are matched by step number; only the
steps present in both files are compared (a run that was stopped early simply has fewer). A
step written twice in one file (say, a restore from an image taken before steps that the
original process went on to write) must agree with itself, or that is a mismatch too. A torn
last line (a process killed mid-write) is ignored.

    python tests/gpu/compare_steps.py A B [--min-steps N]   # exit 0 identical, 1 mismatch/too few
"""

from __future__ import annotations

import argparse
import sys

Mismatch = tuple  # (step, value in a, value in b): each value is "loss checksum" (or a note)


def read_steps(path: str) -> tuple[dict[int, str], Mismatch | None]:
    """step -> "loss checksum", and the first step written twice with different values."""
    steps: dict[int, str] = {}
    clash = None
    with open(path) as f:
        lines = f.read().split("\n")
    lines.pop()  # "" after the final newline, or a torn last line: ignored either way
    for n, line in enumerate(lines):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 3 or not parts[0].isdigit():
            raise ValueError(f"{path}:{n + 1}: not a steps line: {line!r}")
        step, value = int(parts[0]), f"{parts[1]} {parts[2]}"
        if step in steps and steps[step] != value and clash is None:
            clash = (step, f"{steps[step]} (first in {path})", f"{value} (rewritten there)")
        steps.setdefault(step, value)
    return steps, clash


def compare(a_path: str, b_path: str) -> tuple[int, Mismatch | None]:
    """(number of steps compared, first mismatch as (step, a_value, b_value) or None)."""
    a, clash_a = read_steps(a_path)
    b, clash_b = read_steps(b_path)
    common = sorted(a.keys() & b.keys())
    mismatches = [(s, a[s], b[s]) for s in common if a[s] != b[s]]
    mismatches += [c for c in (clash_a, clash_b) if c is not None]
    first = min(mismatches, key=lambda m: m[0]) if mismatches else None
    return len(common), first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="compare two torch_program.py steps files")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--min-steps", type=int, default=1, help="fail if fewer steps are in common")
    args = p.parse_args(argv)
    n, first = compare(args.a, args.b)
    if first is not None:
        step, va, vb = first
        print(f"MISMATCH at step {step} ({n} steps in common):\n  a: {va}\n  b: {vb}")
        return 1
    if n < args.min_steps:
        print(f"only {n} steps in common, wanted at least {args.min_steps}")
        return 1
    print(f"identical: {n} steps compared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
