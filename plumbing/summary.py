"""The lines a train.py run ends with: held-out EM before and after, the exact sign test over the
questions whose score changed and its verdict in words, where the step's time went, peak memory."""
import json
import math
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


def paired_change(before: dict, after: dict) -> str:
    """' (N questions: R turned right, W turned wrong; sign test p = P)', or '' without per-question results."""
    t = sign_test(before, after)
    return f" ({t['questions']} questions: {t['right']} turned right, {t['wrong']} turned wrong; " \
           f"sign test p = {t['p']:.2g})" if t else ""


def verdict(test: dict) -> str:
    """What a sign test says, in words a newcomer can act on."""
    if test["p"] >= 0.05:
        return (f"within noise (p = {test['p']:.2g} >= 0.05): a change this size comes up by chance; more steps "
                "(--steps) or more held-out questions (--eval-size) would tell")
    if test["right"] > test["wrong"]:
        return f"beyond noise (p = {test['p']:.2g} < 0.05): the policy learned"
    return f"EM fell beyond noise (p = {test['p']:.2g} < 0.05): training hurt; try a smaller --lr"


def final_report(run_dir: Path, summary: dict) -> str:
    """Final report: EM before/after and whether the change is beyond noise, where the curves and
    views are, where the time went, peak memory."""
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
    steps = [l for l in lines if "reward" in l]
    parts = ["rollout", "logprob", "update"]
    total = {p: sum(l[f"timing/{p}"] for l in steps) for p in parts + ["step"]}
    text = [f"run {run_dir}: {len(steps)} steps logged; reward, displacement of correct responses, entropy "
            f"and grad norm per step in {run_dir / 'curves.png'}"]
    if (run_dir / "views" / "index.html").exists():
        text.append(f"each token's change of likelihood, step by step: {run_dir / 'views' / 'index.html'}")
    if summary["before"] and summary["after"]:
        text.append(f"held-out EM: before {summary['before']['eval/em']:.3f} -> after "
                    f"{summary['after']['eval/em']:.3f}{paired_change(summary['before'], summary['after'])}")
        test = sign_test(summary["before"], summary["after"])
        if test:
            text.append("  " + verdict(test))
    if total["step"] > 0:
        text.append("step time: " + ", ".join(f"{p} {total[p] / total['step']:.0%}" for p in parts)
                    + f" of {total['step'] / len(steps):.1f} s/step")
    if summary.get("peak_memory_gb"):
        text.append(f"peak memory {summary['peak_memory_gb']:.2f} GiB (allocated on a GPU, process RSS on a CPU)")
    return "\n".join(text)
