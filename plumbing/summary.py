"""The lines a train.py run ends with: held-out EM before and after, the exact sign test over the
questions whose score changed and its verdict in words, where the step's time went, peak memory."""
import json
import math
import statistics
from pathlib import Path


def sign_test(before: dict, after: dict) -> dict | None:
    """The same questions before and after: how many turned right, how many wrong, and the exact
    two-sided sign test of those changes (p: how often training that changed nothing would split
    the changed questions at least this unevenly). None without per-question results."""
    pairs = list(zip(before.get("eval/correct", []), after.get("eval/correct", [])))
    if not pairs:
        return None
    right, wrong = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
    n = right + wrong
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(right, wrong) + 1)) / 2 ** n) if n else 1.0
    return {"questions": len(pairs), "right": right, "wrong": wrong, "p": p}


def paired_change(test: dict | None) -> str:
    """' (N questions: R turned right, W turned wrong; sign test p = P)' of a sign_test, or ''."""
    return (f" ({test['questions']} questions: {test['right']} turned right, {test['wrong']} "
            f"turned wrong; sign test p = {test['p']:.2g})") if test else ""


def verdict(test: dict) -> str:
    """What a sign test says, in words a newcomer can act on."""
    if test["p"] >= 0.05:
        return (f"within noise (p = {test['p']:.2g} >= 0.05): a change this size comes up by chance; more steps "
                "(--steps) or more held-out questions (--eval-size) would tell")
    if test["right"] > test["wrong"]:
        return f"beyond noise (p = {test['p']:.2g} < 0.05): the policy learned"
    return f"EM fell beyond noise (p = {test['p']:.2g} < 0.05): training hurt; try a smaller --lr"


PARTS = ("rollout", "logprob", "update")


def final_report(run_dir: Path, summary: dict) -> str:
    """The report of a finished run: its metrics.jsonl, its views/ and train.train's summary."""
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
    steps = [l for l in lines if "reward" in l]
    seconds = {p: statistics.fmean(l[f"timing/{p}"] for l in steps) for p in (*PARTS, "step")
               } if steps else {}
    before, after = summary["before"], summary["after"]
    em = (before["eval/em"], after["eval/em"]) if before and after else None
    views = sorted(int(p.stem.removeprefix("step_"))
                   for p in (run_dir / "views").glob("step_*.html"))
    return report(run_dir, len(steps), seconds, em, em and sign_test(before, after), views,
                  summary.get("peak_memory_gb"))


def report(run_dir: Path, n_steps: int, seconds: dict, em: tuple | None, test: dict | None,
           views: list[int], peak_gb: float | None) -> str:
    """The report's lines from its numbers (docs/readme_numbers.py prints the README's from a
    record): seconds, the mean of a step and of each of PARTS; em (before, after) or None; test:
    sign_test's or None; views: the steps with a token view."""
    text = [f"run {run_dir}: {n_steps} steps logged; reward, displacement of correct responses, "
            f"entropy and grad norm per step in {run_dir / 'curves.png'}"]
    if views:       # the page of the one step viewed, else the index of all
        which = (f"step {views[0]}'s" if len(views) == 1
                 else f"a step's ({len(views)} steps, the last {views[-1]})")
        page = f"step_{views[0]:04d}.html" if len(views) == 1 else "index.html"
        text.append(f"each token's change of log-prob over {which} updates: "
                    f"{run_dir / 'views' / page}")
    if em:
        text.append(f"held-out EM: before {em[0]:.3f} -> after {em[1]:.3f}{paired_change(test)}")
        if test:
            text.append("  " + verdict(test))
    if seconds.get("step"):
        shares = ", ".join(f"{p} {seconds[p] / seconds['step']:.0%}" for p in PARTS)
        text.append(f"step time: {shares} of {seconds['step']:.1f} s/step")
    if peak_gb:
        text.append(f"peak memory {peak_gb:.2f} GiB (allocated on a GPU, process RSS on a CPU)")
    return "\n".join(text)
