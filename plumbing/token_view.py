"""Where the likelihood fell: one training step's episodes token by token, as JSONL (for a
notebook) and as an HTML page (for a browser), plus one index page per run.

<run>/views/step_NNNN.jsonl   one line per response: group, question, reward, advantage, its
                              displacement (d = log pi_old - log pi_theta summed over its model
                              tokens after the step's updates, > 0: it lost likelihood; llds.py's
                              sign), first query, whether that query is shared with a response of
                              the other outcome in its group, and its tokens after the prompt, each
                              {"text", "kind": "model" | "obs", "change" (its log-prob after minus
                              before the step's updates, so minus its d; None off model tokens),
                              "action" (1..K on model tokens, 0 elsewhere), "llds" (LLDS penalises it
                              at the step's end: a preserving response, an open gate, a fall)}.
<run>/views/step_NNNN.html    the same, group by group, correct responses first: model tokens
                              coloured by their change (red fell, blue rose), observation tokens
                              grey (no gradient), a bar at each action's start, LLDS tokens
                              underlined, the shared first search framed in green.
<run>/views/index.html        one row per written step, linking its page.
"""
import html
import json
from pathlib import Path

import torch

from plumbing.search_health import first_query

STYLE = """<style>
body { font: 14px/1.5 system-ui, sans-serif; margin: 2em; max-width: 75em; }
.group { border-top: 2px solid #444; margin-top: 1.5em; }
.resp { margin: .6em 0; padding: .3em .5em; background: #fafafa; }
.head { font-size: 12px; color: #333; }
.toks { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
.obs { color: #999; }
.start { border-left: 2px solid #000; }
.llds { text-decoration: underline 2px #c80; }
.shared { border-top: 2px solid #2a2; border-bottom: 2px solid #2a2; }
.correct .head b { color: #060; }
</style>"""


def penalised_tokens(llds_loss, after: torch.Tensor, before: torch.Tensor, advantages, loss_mask) -> torch.Tensor:
    """(N, T) bool: the tokens LLDS penalises at `after`: exactly those its loss has a gradient on
    (llds_loss: llds.llds_loss with the run's gate), so the gate is defined in llds.py alone."""
    with torch.enable_grad():
        logp = after.detach().clone().requires_grad_(True)
        llds_loss(logp, before, advantages, loss_mask)[0].backward()
    return logp.grad != 0


def response_rows(tokenizer, out, batch, change: torch.Tensor, group_ids: torch.Tensor, records: list[dict],
                  actions: torch.Tensor, llds_loss) -> list[dict]:
    """The step's responses as JSON-ready dicts (module docstring). change: (N, T) float, after - before
    on model tokens (0 elsewhere); actions: (N, T) long, 1..K per model turn (llds.action_ids); llds_loss:
    llds.llds_loss with the run's gate; out: the rollout; batch: train.py's (loss_mask, advantages, old_logp)."""
    mask = batch["loss_mask"].bool()
    llds_on = penalised_tokens(llds_loss, batch["old_logp"] + change, batch["old_logp"], batch["advantages"],
                               batch["loss_mask"])                                       # at the step's end
    firsts = [first_query(e) for e in out.episodes]
    rows = []
    for i, e in enumerate(out.episodes):
        same_group = torch.nonzero(group_ids == group_ids[i]).flatten().tolist()
        shared = firsts[i] is not None and any(firsts[j] == firsts[i] and (out.episodes[j]["reward"] > 0) !=
                                               (e["reward"] > 0) for j in same_group)
        span = range(int(out.prompt_len[i]), int(batch["attention_mask"][i].sum()))
        tokens = [{"text": tokenizer.decode([int(out.input_ids[i, t])]), "kind": "model" if mask[i, t] else "obs",
                   "change": change[i, t].item() if mask[i, t] else None, "action": int(actions[i, t]),
                   "llds": bool(llds_on[i, t])} for t in span]
        rows.append({"row": i, "group": int(group_ids[i]), "question": records[i]["question"],
                     "golds": e["golds"], "answer": e["answer"], "reward": e["reward"],
                     "advantage": float(batch["advantages"][i]), "displacement": -change[i][mask[i]].sum().item(),
                     "first_query": firsts[i], "shared_first_search": shared, "tokens": tokens})
    return rows


def _colour(change: float, scale: float) -> str:
    alpha = min(abs(change) / scale, 1.0) * 0.85
    return f"rgba(220,40,40,{alpha:.2f})" if change < 0 else f"rgba(40,90,220,{alpha:.2f})"


def page(rows: list[dict], step: int, run_name: str) -> str:
    """The HTML page of one step's rows."""
    changes = sorted(abs(t["change"]) for r in rows for t in r["tokens"] if t["change"] is not None)
    scale = max(changes[int(0.95 * (len(changes) - 1))] if changes else 0.0, 1e-3)   # 95th percentile: full colour
    parts = [f"<!doctype html><meta charset=utf-8><title>{html.escape(run_name)} step {step}</title>{STYLE}",
             f"<h1>{html.escape(run_name)}: step {step}</h1><p>Model tokens coloured by their change of "
             f"log-probability over the step's updates (red fell, blue rose; full colour at |change| >= "
             f"{scale:.3g} nats); a response's displacement is minus their sum (> 0: it lost likelihood); "
             f"observations grey; a bar starts each action; LLDS tokens underlined; a "
             f"first search shared by a correct and an incorrect response of the group framed in green.</p>"]
    for g in sorted({r["group"] for r in rows}):
        group = sorted((r for r in rows if r["group"] == g), key=lambda r: -r["reward"])
        parts.append(f"<div class=group><p><b>Q:</b> {html.escape(group[0]['question'])} "
                     f"<b>gold:</b> {html.escape(', '.join(group[0]['golds']))}</p>")
        for r in group:
            spans, previous = [], 0
            for t in r["tokens"]:
                classes = [t["kind"]] + (["start"] if t["action"] and t["action"] != previous else [])
                classes += (["llds"] if t["llds"] else []) + (["shared"] if r["shared_first_search"] and t["action"] == 1 else [])
                style = f' style="background:{_colour(t["change"], scale)}"' if t["change"] else ""
                tip = f' title="{t["change"]:+.4f}"' if t["change"] is not None else ""
                spans.append(f'<span class="{" ".join(classes)}"{style}{tip}>{html.escape(t["text"])}</span>')
                previous = t["action"]
            parts.append(f'<div class="resp{" correct" if r["reward"] > 0 else ""}"><div class=head><b>reward '
                         f'{r["reward"]:.0f}</b> advantage {r["advantage"]:+.2f} displacement '
                         f'{r["displacement"]:+.3f} answer {html.escape(str(r["answer"]))}</div>'
                         f'<div class=toks>{"".join(spans)}</div></div>')
        parts.append("</div>")
    return "\n".join(parts)


def write_step_view(run_dir: Path, step: int, *args) -> Path:
    """<run>/views/step_NNNN.{jsonl,html} of response_rows(*args), the index page rewritten; -> the step's page."""
    rows = response_rows(*args)
    views = Path(run_dir) / "views"
    views.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:04d}"
    (views / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (views / f"{name}.html").write_text(page(rows, step, Path(run_dir).name))
    lines = []
    for path in sorted(views.glob("step_*.jsonl")):
        rs = [json.loads(line) for line in path.read_text().splitlines()]
        correct = [r["displacement"] for r in rs if r["reward"] > 0]
        mean = f"{sum(correct) / len(correct):+.3f}" if correct else "-"
        lines.append(f'<tr><td><a href="{path.stem}.html">{path.stem}</a></td><td>{len(rs)}</td>'
                     f"<td>{len(correct)}</td><td>{mean}</td></tr>")
    (views / "index.html").write_text(
        f"<!doctype html><meta charset=utf-8><title>{Path(run_dir).name}: token views</title>{STYLE}"
        f"<h1>{Path(run_dir).name}: token views</h1><table><tr><th>step</th><th>responses</th>"
        f"<th>correct</th><th>mean displacement of correct (> 0: lost likelihood)</th></tr>"
        f"{''.join(lines)}</table>")
    return views / f"{name}.html"
