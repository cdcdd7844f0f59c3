"""docs/timeline_graph_x2.png: one CUDA-graph call of decode dispatch + combine on 2 x H200, before
(commit 4a5e29b: every step through the proxy, two barriers) and after (kernels synchronise through
peer memory, proxy idle), from the kernel-side stamps in docs/results/{before_graph_x2,e2e_graph_x2}.json.

    python3 benchmarks/gpu/plot_timelines.py docs/results/before_graph_x2.json docs/results/e2e_graph_x2.json out.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HALVES = {"dispatch_send": "#4c72b0", "dispatch_recv": "#55a868", "combine_send": "#c44e52",
          "combine_recv": "#8172b2"}


def draw(ax, traces, title):
    t0 = min(s[0] for t in traces for s in t["model"].values())
    end = 0.0
    for lane, t in enumerate(traces):
        for half, (a, b) in t["model"].items():
            ax.barh(2 * lane, (b - a) / 1e3, left=(a - t0) / 1e3, color=HALVES[half], label=half if lane == 0 else None)
            end = max(end, (b - t0) / 1e3)
        if t.get("proxy"):
            xs = [(v - t0) / 1e3 for v in t["proxy"].values()]
            ax.scatter(xs, [2 * lane + 0.9] * len(xs), marker="|", s=120, color="black",
                       label="proxy step" if lane == 0 else None)
    ax.set_yticks([2 * i for i in range(len(traces))], [f"rank {t['rank']}" for t in traces])
    ax.set_title(f"{title}: {end:.0f} µs from the first dispatch to the last combine")
    ax.set_xlabel("µs since the first rank started dispatch")
    ax.invert_yaxis()


def main(before_path, after_path, out):
    before = [r["trace"] for r in json.load(open(before_path))["per_rank"]]
    after = [g["trace"] for g in json.load(open(after_path))["presets"]["decode"]["graph"]]
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
    draw(axes[0], before, "before (4a5e29b): every step through the proxy, two barriers")
    draw(axes[1], after, "after: kernels synchronise through peer memory, proxy idle")
    handles, labels = {}, {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle("Decode dispatch + combine, one CUDA-graph call, 2 x H200 (kernel-side %globaltimer stamps)")
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main(*sys.argv[1:4])
