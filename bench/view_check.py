"""Render a token-view page (plumbing/token_view.py) in headless Chromium and check what the browser
shows against the page's JSONL: one coloured span per model token that changed, observation tokens
grey, LLDS tokens underlined, the shared first search outlined; optionally save a screenshot.

    .venv/bin/python bench/view_check.py runs/demo/views/step_0010.html --screenshot docs/token-view.png

Needs Chromium (Debian: apt-get install chromium). Exit 1 when the browser's counts differ.
"""
import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Counted from the computed styles, i.e. what the browser draws, not from the HTML's text.
PROBE = """<script>
const spans = [...document.querySelectorAll('.toks span')], style = s => getComputedStyle(s);
const counts = {
  coloured: spans.filter(s => style(s).backgroundColor !== 'rgba(0, 0, 0, 0)').length,
  grey: spans.filter(s => style(s).color === 'rgb(153, 153, 153)').length,
  underlined: spans.filter(s => style(s).textDecorationLine.includes('underline')).length,
  outlined: spans.filter(s => style(s).borderTopStyle === 'solid').length,
  responses: document.querySelectorAll('.resp').length};
document.body.insertAdjacentHTML('beforeend', '<pre id="counts">' + JSON.stringify(counts) + '</pre>');
</script>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise SystemExit("error: Chromium not found; install it (Debian: apt-get install chromium)")
    return path


def _headless(*args: str) -> str:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]
    return subprocess.run([chromium(), *flags, *args], capture_output=True, text=True, timeout=120, check=True).stdout


def browser_counts(page: Path) -> dict:
    """What Chromium draws on `page`: the counts of PROBE."""
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text() + PROBE)
    try:
        dom = _headless("--dump-dom", probe.resolve().as_uri())
    finally:
        probe.unlink()
    return json.loads(re.findall(r"<pre id=\"counts\">(.*?)</pre>", dom)[-1])   # [-1]: not the one in PROBE


def expected_counts(jsonl: Path) -> dict:
    """The same counts, from the JSONL the page was drawn from."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    tokens = [(r, t) for r in rows for t in r["tokens"]]
    return {"coloured": sum(bool(t["change"]) for _, t in tokens), "grey": sum(t["kind"] == "obs" for _, t in tokens),
            "underlined": sum(t["llds"] for _, t in tokens),
            "outlined": sum(r["shared_first_search"] and t["action"] == 1 for r, t in tokens), "responses": len(rows)}


def screenshot(page: Path, png: Path, width: int = 1200, height: int = 1600) -> None:
    png.parent.mkdir(parents=True, exist_ok=True)
    _headless(f"--screenshot={png.resolve()}", f"--window-size={width},{height}", page.resolve().as_uri())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path, help="a views/step_NNNN.html of a train.py run")
    parser.add_argument("--screenshot", type=Path, help="also save what the browser shows as this PNG")
    args = parser.parse_args()
    shown, expected = browser_counts(args.page), expected_counts(args.page.with_suffix(".jsonl"))
    print(f"browser: {shown}\njsonl:   {expected}")
    if args.screenshot:
        screenshot(args.page, args.screenshot)
        print(f"screenshot: {args.screenshot}")
    if shown != expected:
        sys.exit(1)


if __name__ == "__main__":
    main()
