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
SPIRAL, LATE = ROOT / "experiments/spiral", ROOT / "experiments/late_spiral"


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
           "its held-out seeds have not run yet.")
        + " `--no-spiral-warning` turns it off; a skipped update (non-finite gradient norm) is "
          "reported apart.")


def spiral_held_out() -> tuple[dict, list[dict]]:
    """The warning's design record and the held-out runs that have finished (not its seeds)."""
    from experiments.spiral import detector
    record = json.loads(detector.DESIGN.read_text())
    return record, detector.held_out(SPIRAL / "study", record)


def results() -> str:
    """Every study, strongest evidence first, each from its records: the spiral study's and the
    learning-rate map's run folders, the LLD study's (experiments/lld_study/lld_study.py), the lab
    pilot's (experiments/lab/lab_study.py), the demo's fresh clones; breakdowns by the one rule
    (experiments/breakdowns.py) beside the older studies' own rules."""
    from experiments import breakdowns
    from experiments.lab import lab_study
    from experiments.lld_study import lld_study
    from experiments.spiral import spiral_study

    spiral = spiral_study.outcome(spiral_study.study_rows(SPIRAL / "study"))
    demo = [r for r in records(DEMO_SEEDS) if r["commit"] in CURRENT]
    runs = [lld_study.run_summary(d) for d in sorted(STUDY.iterdir())
            if lld_study.NAME.search(d.name)]
    assert len({r["precision"] for r in runs}) == 1, "lld_study.py never pools precisions"
    done = [r for r in runs if r["finished"]]
    arms = {arm: [r for r in done if r["arm"] == arm] for arm in lld_study.ARMS}
    collapsed = {arm: sum(r["collapse"] is not None for r in mine) for arm, mine in arms.items()}
    broke = {c["arm"]: c["breakdowns"] for c in breakdowns.counts(breakdowns.study_runs(STUDY))}
    disp = lld_study.paired(done, lambda r: r["disp_sum"])
    em = [b - a for _, a, b in lld_study.paired(done, lambda r: r["em_final"])]
    mean, low, high = lld_study.bootstrap_mean(em)
    outcome = ("no difference shown" if low <= 0 <= high
               else "LLDS " + ("higher" if low > 0 else "lower"))
    cells = lab_study.pilot_cells(LAB_PILOT)
    lab = {k: sum(c[k] for c in cells) for k in ("finished", "learned", "collapsed")}
    lab_broke = sum(c["breakdowns"] for c in breakdowns.counts(breakdowns.study_runs(LAB_PILOT)))
    g, l, lr = spiral["grpo"], spiral["llds"], spiral["log_rank"]
    return "\n".join([
        "| study | the question | the answer | details |", "|---|---|---|---|",
        f"| the spiral study, `make spiral` (SmolLM2-135M warm-started, 15 steps at lr 8e-5, "
        f"{g['runs']} seeds x 2 arms, pre-registered) | how often does plain GRPO break down, and "
        f"GRPO + LLDS? | plain GRPO in {g['breakdowns']} of {g['runs']} runs, LLDS in "
        f"{l['breakdowns']} of {l['runs']} (log-rank p = {lr['p']:.2g}); final EM, LLDS - GRPO "
        f"{spiral['em_paired']['mean']:+.2f} [{spiral['em_paired']['low']:+.2f}, "
        f"{spiral['em_paired']['high']:+.2f}] | [spiral](experiments/spiral/README.md) |",
        f"| the learning-rate map, `make lr-map` (the spiral study's setting, 5 learning rates, "
        f"the paper's KL; pre-registered) | what does LLDS buy over a lower learning rate or a "
        f"KL term? | {lr_map_answer()} | [lr_map](experiments/lr_map/README.md) |",
        f"| the LLD study, `make study` (earlier and smaller: {len(disp)} seeds x 2 arms, 20 steps "
        f"at lr 5e-5, T = 0.7) | does LLDS stop GRPO's collapse, and change the outcome? | LLDS "
        f"cut the correct responses' displacement in {sum(b < a for _, a, b in disp)} of "
        f"{len(disp)} seeds; breakdowns by the spiral rule: plain GRPO {broke['grpo']} of "
        f"{len(arms['grpo'])}, LLDS {broke['llds']} (its own entropy rule: {collapsed['grpo']} "
        f"and {collapsed['llds']}); final EM: {outcome} (LLDS - GRPO {mean:+.2f} [{low:+.2f}, "
        f"{high:+.2f}]) | [lld_study](experiments/lld_study/README.md) |",
        f"| the LLD lab, `make lab-study` (~1M-parameter model, {lab['finished']} runs, "
        f"pre-registered) | does a small warm-started agent spiral under plain GRPO? | "
        f"{'no' if not lab['collapsed'] else 'in ' + str(lab['collapsed']) + ' runs'}: "
        f"{lab['learned']} of {lab['finished']} learned, {lab['collapsed'] or 'none'} collapsed "
        f"({lab_broke or 'none'} broke down by the spiral rule), so its LLDS study did not run | "
        f"[lab](experiments/lab/README.md) |",
        f"| the CPU demo, `make train` | does it learn beyond noise? | "
        f"{'yes' if all(map(learned, demo)) else 'not on every seed'}: held-out EM rose on "
        f"seeds {seeds(demo)}, sign test p < 0.05 on {sum(map(learned, demo))} of {len(demo)} "
        f"(fresh clones, {', '.join(sorted({r['date'][:10] for r in demo}))}) | "
        f"[demo_seeds](experiments/demo_seeds/README.md) |"])


def lr_map_answer() -> str:
    """The learning-rate map's answer as far as it has run (experiments/lr_map/lr_map.py)."""
    from experiments.lr_map import lr_map
    rows, landed, registered = lr_map_landed()
    return lr_map.answer(rows) if landed == registered else (
        f"not yet measured ({landed} of the map's {registered} runs have landed)")


def llds_advice() -> str:
    """The map's advice in words once every registered run has landed; nothing before."""
    from experiments.lr_map import lr_map
    rows, landed, registered = lr_map_landed()
    return wrap(f"{lr_map.advice(rows)} ([the map](experiments/lr_map/README.md)).") if (
        landed == registered) else ""


def lr_map_landed() -> tuple[list[dict], int, int]:
    """The map's rows, its new runs landed, and its registered runs."""
    from experiments.lr_map import lr_map, map_runs
    rows = lr_map.map_rows()
    return rows, sum(r["new"] for r in rows), len(map_runs.queue())


def spiral_pilot() -> str:
    """The spiral study's pilot, cell by cell (experiments/spiral/spiral_study.py)."""
    from experiments.spiral import spiral_study
    return "\n".join(spiral_study.pilot_table(SPIRAL / "pilot"))


def study_outcome(folder: Path, figures: str):
    """A pre-registered study's outcome tables, below its figures (spiral_study.py's tables)."""
    def block() -> str:
        from experiments.spiral import spiral_study
        if not folder.is_dir():
            return "No counted seed has finished yet."
        rows = spiral_study.study_rows(folder)
        return figures + "\n\n" + "\n".join(spiral_study.tables(rows, spiral_study.outcome(rows)))
    return block


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
    """The spiral study in two sentences and its figure (experiments/spiral/), then the
    learning-rate map's answer as far as it has run (experiments/lr_map/)."""
    from experiments.spiral import spiral_study
    rows = spiral_study.study_rows(SPIRAL / "study")
    result = spiral_study.outcome(rows)
    arms = {arm: result.get(arm, {"runs": 0, "breakdowns": 0}) for arm in spiral_study.ARMS}
    text = (f"**The spiral, counted** ([pre-registered](experiments/spiral/README.md)): "
            f"SmolLM2-135M, warm-started to search, then 15 steps of GRPO at lr 8e-5 with the "
            f"paper's group size and temperature, {arms['grpo']['runs']} seeds an arm. Plain GRPO "
            f"broke down in {arms['grpo']['breakdowns']} of {arms['grpo']['runs']} runs, GRPO + "
            f"LLDS in {arms['llds']['breakdowns']} of {arms['llds']['runs']} (Fisher's p = "
            f"{result['fisher_p']:.2g}, log-rank p = {result['log_rank']['p']:.2g})")
    if 0 < arms["llds"]["breakdowns"] < arms["grpo"]["breakdowns"]:
        text += ": rarer, not prevented"
    em = result["em_paired"]
    text += (f"; final held-out EM, LLDS - GRPO by seed: {em['mean']:+.2f} "
             f"[{em['low']:+.2f}, {em['high']:+.2f}]. ")
    text += (f"**What that buys over a lower learning rate or the paper's KL term** ([the "
             f"learning-rate map](experiments/lr_map/README.md)): {lr_map_answer()}.")
    return ("![survival curves of plain GRPO and GRPO + LLDS](experiments/spiral/survival.png)"
            "\n\n" + wrap(text))


def lr_map_cells() -> str:
    """The map's figure, its table of cells and its runs' cost (experiments/lr_map/lr_map.py)."""
    from experiments.lr_map import lr_map, map_runs
    from experiments.spiral import spiral_study
    rows = lr_map.map_rows()
    new = [r for r in rows if r["new"]]
    builds = ", ".join(sorted({r["warm_start"][:8] for r in new if r["warm_start"]})) or "-"
    return "\n".join(["![final held-out EM against the learning rate](map.png)", "",
                      *lr_map.cell_table(rows), "",
                      f"Runs landed: {len(new)} of the {len(map_runs.queue())} registered. "
                      + spiral_study.cost(new) + f" Warm-start builds (sha256): {builds}."])


def lr_map_answers() -> str:
    """The map's sensitivity, best learning rates, ranges and KL comparison, and its answers in
    words once every registered run has landed."""
    from experiments.lr_map import lr_map
    rows = lr_map.map_rows()
    return "\n".join(lr_map.summary_lines(rows) + ["", wrap(f"**In words**: {lr_map_answer()}.")])


def lr_map_warning() -> str:
    from experiments.lr_map import lr_map
    return "\n".join(lr_map.warning_table(lr_map.map_rows()))


def late_pilot() -> str:
    """The late spiral's pilot, run by run (experiments/late_spiral/late_study.py)."""
    from experiments.late_spiral import late_study
    return "\n".join(late_study.pilot_table())


def late_phases() -> str:
    """The paper's phases read in the late breakdowns (experiments/late_spiral/late_study.py)."""
    from experiments.late_spiral import late_study
    if not (LATE / "study").is_dir():
        return "No counted seed has finished yet."
    return "\n".join(late_study.phases_table(late_study.study_runs(LATE / "study")))


def late_warning() -> str:
    """The redesigned warning (experiments/late_spiral/design.json) on the counted late runs."""
    from experiments.late_spiral import late_study, warning
    if not warning.DESIGN.exists():
        return "Not designed yet: `warning.py design` writes it before the first counted run."
    if not warning.LATE_RUNS.is_dir():
        return "Designed; no counted run has finished yet."
    return "\n".join(warning.replay(late_study.study_runs(warning.LATE_RUNS)))


def breakdowns_table(only: str | None = None):
    """Every study's breakdowns by the one rule, beside its own rule (experiments/breakdowns.py)."""
    from experiments import breakdowns
    return lambda: "\n".join(breakdowns.table(only=only))


BLOCKS = {"demo": demo, "spiral-warning": spiral_warning, "results": results,
          "spiral-result": spiral_result, "llds-advice": llds_advice}
PAGES = {"README.md": BLOCKS, "experiments/spiral/README.md": {
    "spiral-pilot": spiral_pilot, "spiral-outcome": study_outcome(
        SPIRAL / "study", "![survival of plain GRPO and GRPO + LLDS](survival.png)"),
    "spiral-detector": spiral_detector},
    "experiments/lr_map/README.md": {"lr-map-cells": lr_map_cells,
                                     "lr-map-answers": lr_map_answers,
                                     "lr-map-warning": lr_map_warning},
    "docs/results.md": {"breakdowns": breakdowns_table()},
    "experiments/lld_study/README.md": {"breakdowns": breakdowns_table("lld_study/compare")},
    "experiments/lab/README.md": {"breakdowns": breakdowns_table("lab/pilot")},
    "experiments/late_spiral/README.md": {
        "late-pilot": late_pilot, "late-warning": late_warning, "late-phases": late_phases,
        "late-outcome": study_outcome(
            LATE / "study", "![survival of plain GRPO and GRPO + LLDS](survival.png)\n\n"
            "![the phases: signals aligned at the onsets](phases.png)")}}


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
            n = len(PAGES[page])
            print(f"{page}: {n} block{'s' * (n != 1)} rendered from their records")


if __name__ == "__main__":
    main()
