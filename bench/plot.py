"""Plots for docs/benchmarks.md, drawn from the committed JSON in bench/results/.

A development script, not part of torpor: it needs matplotlib, which is not a runtime
dependency (install it in a separate venv: `python3 -m venv /tmp/plot && /tmp/plot/bin/pip
install matplotlib`, then `/tmp/plot/bin/python bench/plot.py`). It reads only the files named
below and writes PNGs into docs/img/ (or --out); every figure is a number the JSON holds, no
number is typed in here.

    driver_path.png      driver path: per-phase seconds of checkpoint and restore by size
    agent_vs_driver.png  driver path vs agent path by size: checkpoint, restore, suspend, resume
    store.png            one 16 GiB training program: driver path, agent path (agent_path.py's
                         run of that size), store (first and second checkpoint; a first one
                         that ends the program, data files vs streamed) and their restores
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DRIVER = "driver_path-h200-2026-12-02.json"
AGENT = "agent_path-h200-2026-12-03-run1.json"
STORE = "store_e2e-h200-2026-12-03-stream.json"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def driver_path(out: Path) -> None:
    """Stacked per-phase seconds of the driver path, checkpoint and restore, per GiB size."""
    runs = sorted(load(DRIVER)["runs"], key=lambda r: r["gib"])
    phases = ["lock", "checkpoint", "dump", "restore:verify", "restore:preflight",
              "restore:restore", "restore:gpu-restore", "restore:unlock"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(runs))
    for side, offset, names in (("checkpoint", -0.2, phases[:3]), ("restore", 0.2, phases[3:])):
        bottom = [0.0] * len(runs)
        for p in names:
            vals = [r["seconds"].get(p, 0.0) for r in runs]
            ax.bar([i + offset for i in x], vals, 0.38, bottom=bottom, label=p)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x), [f"{r['gib']:g} GiB\n(ckpt | restore)" for r in runs])
    ax.set_ylabel("seconds")
    ax.set_title("driver path on the H200, per phase (" + DRIVER + ")", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "driver_path.png", dpi=110)
    plt.close(fig)


def agent_vs_driver(out: Path) -> None:
    """Driver path vs agent path by size: wall seconds of checkpoint (to /dev/shm), restore,
    suspend and resume, as agent_path.py measured them (a size without a checkpoint run shows
    suspend and resume only)."""
    runs = sorted(load(AGENT)["runs"], key=lambda r: r["gib"])
    ops = [("checkpoint", lambda w: (w.get("checkpoint_shm") or {}).get("checkpoint_wall_s")),
           ("restore", lambda w: (w.get("checkpoint_shm") or {}).get("restore_wall_s")),
           ("suspend", lambda w: (w.get("suspend") or {}).get("wall_s")),
           ("resume", lambda w: (w.get("resume") or {}).get("wall_s"))]
    fig, axes = plt.subplots(1, len(ops), figsize=(11, 3.6), sharey=False)
    for ax, (op, get) in zip(axes, ops):
        for way, marker in (("driver", "o"), ("agent", "s")):
            pts = [(r["gib"], get(r[way])) for r in runs if get(r[way]) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=way)
        ax.set_title(op)
        ax.set_xlabel("GiB of tensors")
        ax.set_xscale("log", base=2)
    axes[0].set_ylabel("seconds (wall)")
    axes[0].legend()
    fig.suptitle("driver path vs in-process agent on the H200 (" + AGENT + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "agent_vs_driver.png", dpi=110)
    plt.close(fig)


def store(out: Path) -> None:
    """One program (the first row of store_e2e): checkpoint and restore seconds by path."""
    row = load(STORE)["rows"][0]
    ends = row.get("ends") or {}
    agent = next((r["agent"].get("checkpoint_disk") for r in load(AGENT)["runs"]
                  if r["gib"] == row["gib"]), None) or {}
    bars = [("driver path", row["driver"]["checkpoint_s"], row["driver"]["restore_s"])]
    if agent.get("checkpoint_wall_s") is not None:   # another run (AGENT), same size, to disk
        bars.append(("agent path\n(agent_path.py)", agent["checkpoint_wall_s"],
                     agent.get("restore_wall_s")))
    bars += [("store, 1st\n(left running,\npack incl.)", row["store"]["first"]["seconds"], None),
             ("store, 2nd\n(ends it)", row["store"]["second"]["seconds"],
              row["store"]["restore_s"])]
    for way in ("files", "stream"):
        if way in ends:
            bars.append((f"store, 1st,\nends it ({way})", ends[way]["checkpoint_s"],
                         ends[way]["restore_s"]))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.38, label="checkpoint")
    ax.bar([i + 0.2 for i in x], [b[2] or 0 for b in bars], 0.38, label="restore")
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title(f"{row['kind']}, {row['gib']:g} GiB on the H200 ({STORE})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "store.png", dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "img")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    driver_path(args.out)
    agent_vs_driver(args.out)
    store(args.out)


if __name__ == "__main__":
    main()
