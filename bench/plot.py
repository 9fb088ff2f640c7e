"""Plots for docs/benchmarks.md, drawn from the committed JSON in bench/results/.

A development script, not part of torpor: it needs matplotlib, which is not a runtime
dependency (Debian's python3-matplotlib: `/usr/bin/python3 bench/plot.py`; or a separate venv:
`python3 -m venv /tmp/plot && /tmp/plot/bin/pip install matplotlib`, then `/tmp/plot/bin/python
bench/plot.py`). It reads only the files named below (or given) and writes PNGs into docs/img/
(or --out); every figure is a number the JSON holds, no number is typed in here. --only draws
some of them (the others are left as they are).

    driver_path.png      driver path: per-phase seconds of checkpoint and restore by size
    agent_vs_driver.png  driver path vs agent path by size: checkpoint, restore, suspend, resume
    store.png            one 16 GiB training program: driver path, agent path (agent_path.py's
                         run of that size), store (first and second checkpoint; a first one
                         that ends the program, data files vs streamed) and their restores
    upstream_path.png    issue 20 item 6, from upstream_path.py's JSON (--upstream, any number:
                         their rows side by side): per row (size, compression, cache), each
                         leg's checkpoint and restore stacked, the disk bound of its archive
                         measured in the same run (a bar's black tick), the speed-up over
                         upstream above it; below, the archive sizes against upstream's
    suspend_pause.png    issue 20's suspend, resume and leave-running pause, from
                         agent_path.py's JSON with --pinned-gib and --pause (--agent-targets):
                         per size (and the JAX program), the driver path, the agent, and the
                         bound measured in the same run (copy at the pinned rate + the driver's
                         residual; for the pause issue 20's 1.5 x copy + 1 s)
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
UPSTREAM = ["upstream_path-h200-4gib-2026-12-04.json"]
LEG_NAMES = {"upstream": "upstream\n(CRIU cuda plugin)", "driver": "torpor\ndriver path",
             "agent": "torpor\nagent", "store": "torpor\nagent + store"}


def load(name: str | Path) -> dict:
    """A results file by name (bench/results/) or by path."""
    path = Path(name)
    return json.loads((path if path.exists() else RESULTS / name).read_text())


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


def upstream(out: Path, names: list[str]) -> None:
    """upstream_path.py's rows (every file's, in order): checkpoint + restore per leg, the disk
    bound of each leg's archive, the speed-up over upstream; archive GB below. A leg that did
    not finish (skipped, failed, cut short) is left out of its row."""
    rows = [(name, row) for name in names for row in load(name)["rows"]]
    done = lambda v: "end_to_end_s" in v and "error" not in v   # noqa: E731
    rows = [(n, r) for n, r in rows if any(done(v) for v in r["legs"].values())]
    if not rows:
        raise SystemExit(f"no finished leg in {names}")
    fig, axes = plt.subplots(2, len(rows), figsize=(max(7.5, 3.8 * len(rows) + 1), 6.4), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.3]})
    for k, (name, row) in enumerate(rows):
        legs = [(leg, v) for leg, v in row["legs"].items() if done(v)]
        ratios = row.get("ratios_vs_upstream", {})
        x = list(range(len(legs)))
        ax, ax2 = axes[0][k], axes[1][k]
        ck = [v["checkpoint_s"] for _, v in legs]
        rs = [v["restore_s"] for _, v in legs]
        ax.bar(x, ck, 0.6, label="checkpoint (podman --export)", color="tab:blue")
        ax.bar(x, rs, 0.6, bottom=ck, label="restore (podman --import)", color="tab:orange")
        for i, (leg, v) in enumerate(legs):
            if v.get("disk_bound_s") is not None:
                ax.hlines(v["disk_bound_s"], i - 0.34, i + 0.34, colors="black", linewidth=2.5,
                          label="archive written + read at the disk's rates (same run)"
                          if i == 0 else None)
            sp = ratios.get(leg, {}).get("end_to_end_speedup")
            ax.annotate(f"{v['end_to_end_s']:.1f} s" + (f"\n{sp:.2f}x" if sp else ""),
                        (i, v["end_to_end_s"]), ha="center", va="bottom", fontsize=7)
        title = f"{row['gib']:g} GiB live" + (f" + {row['cache_gib']:g} GiB cached"
                                              if row.get("cache_gib") else "")
        ax.set_title(f"{title}, --compress {row['compress']}", fontsize=9)
        ax.set_xticks(x, [LEG_NAMES.get(leg, leg) for leg, _ in legs], fontsize=7)
        ax.set_ylim(0, max(v["end_to_end_s"] for _, v in legs) * 1.45)
        arch = [v["archive_bytes"] / 1e9 for _, v in legs]
        ax2.bar(x, arch, 0.6, color="tab:gray")
        for i, (leg, _) in enumerate(legs):
            a = ratios.get(leg, {}).get("archive_ratio")
            ax2.annotate(f"{arch[i]:.1f} GB" + (f"\n{a:.2f}x" if a else ""), (i, arch[i]),
                         ha="center", va="bottom", fontsize=7)
        ax2.set_xticks(x, [leg for leg, _ in legs], fontsize=7)
        ax2.set_ylim(0, max(arch) * 1.45)
        if k == 0:
            ax.set_ylabel("seconds, end to end")
            ax2.set_ylabel("archive GB")
    seen: dict = {}                       # every panel's entries (the tick only where measured)
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    axes[0][0].legend(list(seen.values()), list(seen), fontsize=7, loc="upper left")
    fig.suptitle("podman checkpoint --export / restore --import of a PyTorch GPU container, "
                 "legs side by side in one run\n" + ", ".join(Path(n).name for n in names) +
                 "\n(upstream: CRIU 4.2.1's cuda plugin; its cuda-checkpoint is a stand-in "
                 "with r555+'s command line)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "upstream_path.png", dpi=110)
    plt.close(fig)


def suspend_pause(out: Path, name: str) -> None:
    """agent_path.py's issue 20 figures: per size (and the JAX program), suspend and resume
    (driver path, agent, the bound) and each leave-running pause (paused, durable, target)."""
    doc = load(name)
    groups = [(f"{r['gib']:g} GiB torch", r) for r in doc.get("runs", []) if "bounds" in r]
    j = doc.get("jax") or {}
    if "bounds" in j:
        groups.append((f"JAX {j['gib']:g} GiB,\npreallocated", j))
    if not groups:
        raise SystemExit(f"{name}: no size with bounds (run agent_path.py with --pinned-gib)")
    fig, axes = plt.subplots(1, len(groups), figsize=(4.4 * len(groups) + 0.6, 4.2),
                             squeeze=False)
    series = [("driver path", "tab:red"), ("agent", "tab:blue"), ("bound (same run)", "black")]
    for ax, (label, row) in zip(axes[0], groups):
        b = row["bounds"]
        cats = []
        for op in ("suspend", "resume"):
            r = b.get(op, {})
            sp = r.get("speedup")
            cats.append((op, [r.get("driver_s"), r.get("wall_s"), r.get("bound_s")],
                         f"\n{sp:.1f}x" if sp else ""))
        for key, p in b.items():
            if key.startswith("pause_"):
                d = p.get("durable_s")
                cats.append((f"leave-running\npause ({key[6:]})",
                             [None, p.get("paused_s"), p.get("target_s")],
                             f"\ndurable {d:.1f} s" if d is not None else ""))
        x = list(range(len(cats)))
        for s_i, (sname, color) in enumerate(series):
            vals = [c[1][s_i] for c in cats]
            xs = [i + (s_i - 1) * 0.27 for i in x]
            ax.bar([xi for xi, v in zip(xs, vals) if v is not None],
                   [v for v in vals if v is not None], 0.26, color=color, label=sname,
                   alpha=0.85 if s_i < 2 else 0.45)
        for i, (_, vals, more) in enumerate(cats):
            if vals[1] is not None:
                ax.annotate(f"{vals[1]:.2f} s{more}", (i, vals[1]), ha="center", va="bottom",
                            fontsize=7)
        ax.set_xticks(x, [c[0] for c in cats], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("seconds")
    axes[0][0].legend(fontsize=7)
    pin = doc.get("pinned_copy_gb_per_s") or {}
    fig.suptitle(f"suspend, resume, leave-running pause ({Path(name).name}); pinned copies "
                 f"in the same run: d2h {pin.get('d2h', 0):.1f}, h2d {pin.get('h2d', 0):.1f} "
                 "GB/s\nbound: moved bytes at the pinned rate + the driver's residual; pause: "
                 "issue 20's 1.5 x copy + 1 s", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "suspend_pause.png", dpi=110)
    plt.close(fig)


FIGURES = ("driver_path", "agent_vs_driver", "store", "upstream", "suspend_pause")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "img")
    p.add_argument("--only", nargs="+", choices=FIGURES, help="draw only these")
    p.add_argument("--upstream", nargs="+", default=UPSTREAM,
                   help="upstream_path.py JSON files (bench/results/ names or paths)")
    p.add_argument("--agent-targets", help="agent_path.py JSON with --pinned-gib (suspend_pause"
                   ".png; none: not drawn)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only or FIGURES)
    if "driver_path" in only:
        driver_path(args.out)
    if "agent_vs_driver" in only:
        agent_vs_driver(args.out)
    if "store" in only:
        store(args.out)
    if "upstream" in only:
        upstream(args.out, args.upstream)
    if "suspend_pause" in only and args.agent_targets:
        suspend_pause(args.out, args.agent_targets)


if __name__ == "__main__":
    main()
