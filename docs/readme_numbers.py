"""docs/readme_numbers.py: the measured numbers of README.md and of the spiral study's README,
rendered from their committed records.

    .venv/bin/python docs/readme_numbers.py            # rewrite the pages' blocks (make docs)
    .venv/bin/python docs/readme_numbers.py --check    # exit 1 with a diff where a page differs

A block of a page (PAGES) runs from a line `<!-- make docs: NAME -->` to the next `<!-- end -->`,
and the page's BLOCKS[NAME] writes it: a number changes when its record (or the code that prints
it) changes, never by hand, and tests/test_readme.py fails when README.md differs from what this
renders. A figure with no record has no block: it is not in the README. The records: the runs of
`make train` on fresh clones (experiments/demo_seeds/runs.jsonl), the demo against LoRA on an
AVX2-only CPU (bench/lora_vs_full.jsonl), the run folders of the LLD study and of the LLD lab's
pilot, and those of the spiral study with its warning's design (experiments/spiral/).
"""
import argparse
import difflib
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing.summary import report  # noqa: E402

BLOCK = re.compile(r"^<!-- make docs: ([\w-]+) -->\n.*?^<!-- end -->$", re.M | re.S)
DEMO_SEEDS, LORA = "experiments/demo_seeds/runs.jsonl", "bench/lora_vs_full.jsonl"
# The training path of today on fresh clones: these two commits compute the same numbers
# (docs/benchmarks.md); the older rows of runs.jsonl stay there, not here.
CURRENT = {"54372b4", "03c073d"}
STUDY, LAB_PILOT = ROOT / "experiments/lld_study/compare", ROOT / "experiments/lab/pilot"
SPIRAL = ROOT / "experiments/spiral"


def records(path: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / path).read_text().splitlines() if line]


def alone(row: dict) -> bool:
    """A run that shared the machine says so in its note: its times are not the CPU's."""
    return not row.get("note", "").startswith("shared")


def learned(row: dict) -> bool:
    """Held-out EM rose beyond noise: the sign test over the questions that changed."""
    return row["p"] < 0.05 and row["after"] > row["before"]


def step_seconds(row: dict) -> float:
    """s/step: lora_vs_full.py records its split, demo_seeds.py the mean alone."""
    return row["s_per_step"]["step"] if isinstance(row["s_per_step"], dict) else row["s_per_step"]


def span(values, spec: str = "") -> str:
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}-{high}"


def seeds(rows: list[dict]) -> str:
    """'0-4', '0, 2' or '2': the rows' seeds."""
    s = sorted(r["seed"] for r in rows)
    return f"{s[0]}-{s[-1]}" if len(s) > 2 and s == list(range(s[0], s[-1] + 1)) else \
        ", ".join(map(str, s))


def wrap(text: str) -> str:
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


def makefile_hint() -> str:
    """The line `make train` prints last: the Makefile's echo after train.py."""
    line = re.search(r'^\t@echo "(next: .*)"$', (ROOT / "Makefile").read_text(), re.M).group(1)
    return line.replace('\\"', '"')


def demo() -> str:
    """How `make train` ends, then its time, memory and held-out EM by CPU. The report is printed by
    train.py's own code from the record of seed 0 on the AVX2 EPYC (a run of train.py's defaults),
    then comes the Makefile's hint; the table holds the runs of today's code that ran alone."""
    from train import Config

    xeon = [r for r in records(DEMO_SEEDS) if r["commit"] in CURRENT and alone(r)]
    full = [r for r in records(LORA) if r["arm"] == "full" and alone(r)]
    lora = [r for r in records(LORA) if r["arm"] == "lora" and alone(r)]
    seed0 = next(r for r in full if r["seed"] == 0)
    assert seed0["args"] == "--out-dir runs", "the record must be a run of train.py's defaults"
    cfg = Config()
    views = [s for s in range(1, cfg.steps + 1)
             if s == cfg.steps or (cfg.token_view_every and s % cfg.token_view_every == 0)]
    test = {k: seed0[k] for k in ("questions", "right", "wrong", "p")}
    text = report(Path("runs/demo"), cfg.steps, seed0["s_per_step"],
                  (seed0["before"], seed0["after"]), test, views, seed0["peak_rss_gib"])
    lines = ["", textwrap.indent(text + "\n" + makefile_hint(), "    "), "", wrap(
        f"That is seed 0 of the AVX2 row below (commit {seed0['commit']}, "
        f"{seed0['date'][:10]}, `{LORA}`). On 2 cores, each run alone "
        f"([every run](docs/benchmarks.md)):"), "",
        "| CPU, precision | what ran | seeds | wall time | s/step | peak RSS | held-out EM before "
        "-> after | sign test p < 0.05 | day, commit |", "|---" * 9 + "|"]
    for cpu, what, rows in (
            ("Intel Xeon with AMX, bf16", "`make train` on a fresh clone, install included", xeon),
            ("AMD EPYC with AVX2 only, float32", "`train.py`, its cache built", full),
            ("the same, LoRA: `ARGS=\"--lora-rank 32 --lr 5e-4\"`", "`train.py`, its cache built",
             lora)):
        timed = [r for r in rows if r["wall_s"] is not None]
        wall = span([r["wall_s"] / 60 for r in timed], ".1f") + " min"
        if len(timed) < len(rows):
            wall += f" (seed{'s' * (len(timed) > 1)} {seeds(timed)})"
        days = sorted({r["date"][:10] for r in rows})
        em = [span([r[k] for r in rows], ".2f") for k in ("before", "after")]
        lines.append(" | ".join([
            f"| {cpu}", what, seeds(rows), wall, span([step_seconds(r) for r in rows], ".0f"),
            span([r["peak_rss_gib"] for r in rows], ".2f") + " GiB", " -> ".join(em),
            f"{sum(map(learned, rows))} of {len(rows)}",
            f"{', '.join(days)}, {', '.join(dict.fromkeys(r['commit'] for r in rows))} |"]))
    return "\n".join(lines)


def spiral_warning() -> str:
    """The death-spiral warning's rule (monitor.RULE, designed in experiments/spiral/design.json)
    and its score on its design runs and on the spiral study's held-out runs that have finished."""
    import monitor
    from experiments.spiral import detector
    record, held = spiral_held_out()
    design = detector.load(SPIRAL / "study", detector.seed_range(record["design_seeds"]))

    def scored(runs):
        s = detector.score(monitor.RULE, runs)
        lead = f" (median lead {s['median_lead']:g})" if s["warned"] else ""
        return f"{s['warned']} of {s['breakdowns']}{lead} and {s['false_alarms']} of {s['calm']}"
    total = detector.HELD_OUT_RUNS
    so_far = "" if len(held) == total else f" so far ({len(held)} of {total})"
    return wrap(
        f"`lld/warning` fires at each step where {monitor.RULE_TEXT}, the rule [the spiral "
        f"study](experiments/spiral/README.md) designed on seeds {record['design_seeds']} "
        "(`make spiral`). "
        f"Breakdowns warned {detector.LEAD} or more steps ahead, and runs without one warned: "
        f"{scored(design)} on its {len(design)} design runs; "
        + (f"{scored(held)} on the held-out runs{so_far}." if held else
           "its held-out seeds have not run yet."))


def spiral_held_out() -> tuple[dict, list[dict]]:
    """The warning's design record and the held-out runs that have finished (not its seeds)."""
    from experiments.spiral import detector
    record = json.loads(detector.DESIGN.read_text())
    return record, detector.held_out(SPIRAL / "study", record)


def results() -> str:
    """The three results, each from its records: the demo's fresh clones, the LLD study's run
    folders (experiments/lld_study/lld_study.py), the lab pilot's (experiments/lab/lab_study.py)."""
    from experiments.lab import lab_study
    from experiments.lld_study import lld_study

    demo = [r for r in records(DEMO_SEEDS) if r["commit"] in CURRENT]
    runs = [lld_study.run_summary(d) for d in sorted(STUDY.iterdir())
            if lld_study.NAME.search(d.name)]
    assert len({r["precision"] for r in runs}) == 1, "lld_study.py never pools precisions"
    done = [r for r in runs if r["finished"]]
    arms = {arm: [r for r in done if r["arm"] == arm] for arm in lld_study.ARMS}
    collapsed = {arm: sum(r["collapse"] is not None for r in mine) for arm, mine in arms.items()}
    disp = lld_study.paired(done, lambda r: r["disp_sum"])
    em = [b - a for _, a, b in lld_study.paired(done, lambda r: r["em_final"])]
    mean, low, high = lld_study.bootstrap_mean(em)
    outcome = ("no difference shown" if low <= 0 <= high
               else "LLDS " + ("higher" if low > 0 else "lower"))
    cells = lab_study.pilot_cells(LAB_PILOT)
    lab = {k: sum(c[k] for c in cells) for k in ("finished", "learned", "collapsed")}
    return "\n".join([
        "| experiment | the question | the answer | details |", "|---|---|---|---|",
        f"| the CPU demo, `make train` | does it learn beyond noise? | "
        f"{'yes' if all(map(learned, demo)) else 'not on every seed'}: held-out EM rose on "
        f"seeds {seeds(demo)}, sign test p < 0.05 on {sum(map(learned, demo))} of {len(demo)} "
        f"(fresh clones, {', '.join(sorted({r['date'][:10] for r in demo}))}) | "
        f"[benchmarks](docs/benchmarks.md) |",
        f"| the LLD study, `make study` (SmolLM2-135M, {len(disp)} seeds x 2 arms) | does LLDS "
        f"stop GRPO's collapse, and change the outcome? | LLDS cut the correct responses' "
        f"displacement in {sum(b < a for _, a, b in disp)} of {len(disp)} seeds; plain GRPO "
        f"collapsed in {collapsed['grpo']} of {len(arms['grpo'])} runs, LLDS in "
        f"{collapsed['llds']}; final EM: {outcome} (LLDS - GRPO {mean:+.2f}, 95% interval "
        f"[{low:+.2f}, {high:+.2f}]) | [lld_study](experiments/lld_study/README.md) |",
        f"| the LLD lab, `make lab-study` (~1M-parameter model, {lab['finished']} runs, "
        f"pre-registered) | does a small warm-started agent spiral under plain GRPO? | "
        f"{'no' if not lab['collapsed'] else 'in ' + str(lab['collapsed']) + ' runs'}: "
        f"{lab['learned']} of {lab['finished']} learned, {lab['collapsed'] or 'none'} collapsed, "
        f"so its LLDS study did not run | [lab](experiments/lab/README.md) |"])



def spiral_pilot() -> str:
    """The spiral study's pilot, cell by cell (experiments/spiral/spiral_study.py)."""
    from experiments.spiral import spiral_study
    return "\n".join(spiral_study.pilot_table(SPIRAL / "pilot"))


def spiral_outcome() -> str:
    """The counted seeds' outcome tables (experiments/spiral/spiral_study.py)."""
    from experiments.spiral import spiral_study
    if not (SPIRAL / "study").is_dir():
        return "No counted seed has finished yet."
    rows = spiral_study.study_rows(SPIRAL / "study")
    figure = "![survival of plain GRPO and GRPO + LLDS](survival.png)\n\n"
    return figure + "\n".join(spiral_study.tables(rows, spiral_study.outcome(rows)))


def spiral_detector() -> str:
    """The warning's design (experiments/spiral/design.json) scored on the design seeds and on
    the held-out runs that have finished (experiments/spiral/detector.py)."""
    from experiments.spiral import detector
    if not detector.DESIGN.exists():
        return "No design yet: it is made on seeds 0-14 once both arms of each have finished."
    record, held = spiral_held_out()
    design = detector.seed_range(record["design_seeds"])
    lines = [f"Design seeds {record['design_seeds']}, both arms:", ""]
    lines += detector.table(record, SPIRAL / "study", design)
    names = ", ".join(r["run"] for r in held)
    lines += ["", f"Held-out runs finished: {len(held)} of {detector.HELD_OUT_RUNS}"
              + (f" ({names})" if 0 < len(held) < detector.HELD_OUT_RUNS else "") + "."]
    if not held:
        return "\n".join(lines)
    seeds = {detector.seed_of(r["run"]) for r in held}
    return "\n".join(lines + [""] + detector.table(record, SPIRAL / "study", seeds))


def spiral_result() -> str:
    """The spiral study in two sentences and its figure (experiments/spiral/), as far as it ran."""
    from experiments.spiral import spiral_study
    if not (SPIRAL / "study").is_dir():
        return wrap("**The spiral, counted** ([experiments/spiral](experiments/spiral/README.md), "
                    "pre-registered): plain GRPO against GRPO + LLDS over 30 seeds each, as "
                    "survival curves; no counted seed has finished yet.")
    rows = spiral_study.study_rows(SPIRAL / "study")
    result = spiral_study.outcome(rows)
    arms = {arm: result.get(arm, {"runs": 0, "breakdowns": 0}) for arm in spiral_study.ARMS}
    planned = "" if min(a["runs"] for a in arms.values()) >= 30 else " planned"
    text = (f"**The spiral, counted** over 30 seeds an arm{planned} ([pre-registered]"
            f"(experiments/spiral/README.md)): plain GRPO broke down in "
            f"{arms['grpo']['breakdowns']} of {arms['grpo']['runs']} runs, GRPO + LLDS in "
            f"{arms['llds']['breakdowns']} of {arms['llds']['runs']}")
    if "fisher_p" in result:
        text += (f" (Fisher's p = {result['fisher_p']:.2g}, log-rank p = "
                 f"{result['log_rank']['p']:.2g})")
    if 0 < arms["llds"]["breakdowns"] < arms["grpo"]["breakdowns"]:
        text += ": rarer, not prevented"
    em = result.get("em_paired")
    if em:
        text += (f". Final held-out EM, LLDS - GRPO by seed: {em['mean']:+.2f} "
                 f"[{em['low']:+.2f}, {em['high']:+.2f}]")
    return ("![survival curves of plain GRPO and GRPO + LLDS](experiments/spiral/survival.png)"
            "\n\n" + wrap(text + "."))


BLOCKS = {"demo": demo, "spiral-warning": spiral_warning, "results": results,
          "spiral-result": spiral_result}
PAGES = {"README.md": BLOCKS, "experiments/spiral/README.md": {
    "spiral-pilot": spiral_pilot, "spiral-outcome": spiral_outcome,
    "spiral-detector": spiral_detector}}


def render(text: str, page: str = "README.md") -> str:
    """A page's text with every block written afresh; a block unknown here, or one of its BLOCKS
    missing there, is an error."""
    blocks, found = PAGES[page], BLOCK.findall(text)
    unknown, missing = set(found) - set(blocks), set(blocks) - set(found)
    if unknown or missing:
        raise SystemExit(f"error: {page}'s blocks {sorted(unknown)} are not rendered here, and "
                         f"{sorted(missing)} are not in {page}")
    return BLOCK.sub(lambda m: f"<!-- make docs: {m.group(1)} -->\n{blocks[m.group(1)]()}\n"
                               "<!-- end -->", text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 with a diff when a page differs")
    args = parser.parse_args(argv)
    for page in PAGES:
        old = (ROOT / page).read_text()
        new = render(old, page)
        if args.check:
            if new != old:
                raise SystemExit("\n".join(difflib.unified_diff(
                    old.splitlines(), new.splitlines(), page, "rendered", lineterm="")))
            print(f"{page}: its numbers are what their records give")
        else:
            (ROOT / page).write_text(new)
            print(f"{page}: {len(PAGES[page])} blocks rendered from their records")


if __name__ == "__main__":
    main()
