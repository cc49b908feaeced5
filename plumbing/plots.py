"""Training curves: one run (<run>/curves.png), or several overlaid in one figure, one colour
per run, the legend naming each run and the settings in which the runs differ."""
import json
from pathlib import Path

from plumbing.metrics_file import read_metrics

GRAD_NORM = "grad norm (max over the step's updates; 0 not drawn)"   # log scale; all-tied steps have norm 0
# (title, [(metric key, line style)]): solid = the first key, dashed = the second.
PANELS = [("training reward (-), held-out EM (--)", ["reward", "eval/em"]),
          ("mean token log-lik, correct (-) / incorrect (--)", ["lld/logp_correct", "lld/logp_incorrect"]),
          ("correct responses' displacement (> 0: lost likelihood)", ["lld/correct_displacement"]),
          ("LLDS active token fraction", ["llds/active_token_frac"]),
          ("entropy", ["entropy"]),
          (GRAD_NORM, ["grad_norm_max"]),
          ("searches per episode (-), passages holding the answer (--)", ["searches", "search/answer_in_passages"]),
          ("correct/incorrect pairs sharing the first query", ["lld/shared_first_search"])]
STYLES = ["-", "--"]
IGNORED = {"name", "out_dir", "resume"}     # settings that never make runs differ


def series(lines: list[dict], key: str, positive_only=False) -> list[tuple]:
    """(step, value) of the lines that logged `key`; positive_only for a log-scale panel."""
    return [(l["step"], l[key]) for l in lines
            if l.get(key) is not None and (not positive_only or l[key] > 0)]


def run_labels(run_dirs: list[Path]) -> list[str]:
    """'<name>' for one run; '<name> (key=value, ...)' with the settings that differ for several."""
    configs = []
    for d in run_dirs:
        path = Path(d) / "config.json"
        configs.append(json.loads(path.read_text()) if path.exists() else {})
    keys = sorted({k for c in configs for k in c} - IGNORED)
    differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
    labels = []
    for d, c in zip(run_dirs, configs):
        settings = ", ".join(f"{k}={c.get(k)}" for k in differ)
        labels.append(f"{Path(d).name} ({settings})" if settings and len(run_dirs) > 1 else Path(d).name)
    return labels


def plot_runs(run_dirs, out=None) -> Path:
    """Draw the curves of one run into <run>/curves.png, or of several into `out` (default:
    compare.png beside the first run). Works on finished and on killed runs. -> the PNG's path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(d) for d in run_dirs]
    out = Path(out) if out else (run_dirs[0] / "curves.png" if len(run_dirs) == 1
                                 else run_dirs[0].parent / "compare.png")
    runs = [read_metrics(d) for d in run_dirs]
    fig, axes = plt.subplots(2, 4, figsize=(19, 8))
    for colour, (lines, label) in enumerate(zip(runs, run_labels(run_dirs))):
        for ax, (title, keys) in zip(axes.flat, PANELS):
            for key, style in zip(keys, STYLES):
                points = series(lines, key, positive_only=title == GRAD_NORM)
                if points:
                    ax.plot(*zip(*points), style, color=f"C{colour}", marker="o", markersize=3,
                            label=label if ax is axes.flat[0] and style == "-" else None)
    for ax, (title, _) in zip(axes.flat, PANELS):
        if title == GRAD_NORM and ax.lines:
            ax.set_yscale("log")
        if "displacement" in title:
            ax.axhline(0.0, color="grey", linewidth=0.8)     # above 0: the correct ones lost
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=min(len(run_dirs), 3), fontsize=9, frameon=False)
    fig.suptitle("GRPO + LLDS training curves" if len(run_dirs) == 1 else "runs compared")
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(run_dirs) - 1) // 3), 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
