"""The README's LLD table (bench/lld_table.py) on hand-built metrics."""
import json

from bench import lld_table


def test_longest_fall_finds_the_longest_run_of_decreases():
    points = [(1, -0.1), (2, -0.2), (3, -0.1), (4, -0.2), (5, -0.3), (6, -0.5), (7, -0.4)]
    step_a, step_b, drop = lld_table.longest_fall(points)
    assert (step_a, step_b) == (3, 6) and abs(drop - (-0.4)) < 1e-12
    assert lld_table.longest_fall([(1, 0.0), (2, 0.1)]) is None


def test_collapse_needs_reward_halved_and_entropy_up():
    line = lambda step, reward, entropy: {"step": step, "reward": reward, "entropy": entropy}  # noqa: E731
    rewards = [0.3] * 5 + [0.0] * 5
    # 5-step mean: best 0.3 up to step 5, then 0.24, 0.18, 0.12 (< 0.15 at step 8)
    assert lld_table.collapse_step([line(i + 1, r, 1.0 if i < 7 else 2.0) for i, r in enumerate(rewards)]) == 8
    assert lld_table.collapse_step([line(i + 1, r, 1.0) for i, r in enumerate(rewards)]) is None


def test_row_reads_a_run_folder(tmp_path):
    lines = [{"step": 0, "eval/em": 0.2}] + [
        {"step": s, "reward": 0.1 * s, "entropy": 0.5, "grad_norm_max": float(s), "timing/step": 10.0,
         "lld/logp_correct": -0.1 * s, "lld/displacement_correct": 1.0 - s} for s in (1, 2, 3)]
    lines.append({"step": 3, "eval/em": 0.4})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    assert lld_table.row(tmp_path) == (
        f"| {tmp_path.name} | 3 | 0.20 -> 0.20 | 0.20 -> 0.40 (step 3) | steps 1-3: -0.200 | "
        "-2.00 (step 3) | 0.500 -> 0.500 | 1 -> 3 | - | 10 |")
