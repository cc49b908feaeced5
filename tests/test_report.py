"""Tests for plumbing/run_log.py (--report-to): a tiny train() run sends metrics.jsonl to
TensorBoard and W&B (offline), and each library's own files, read back with its own reader
(TensorBoard's EventAccumulator, W&B's protobuf records in the offline run's .wandb file), hold
the same numbers under the same names and steps, with the config as hyper-parameters."""
import importlib.util
import json
import struct

import pytest

import train
from plumbing import run_log
from test_train import tiny_config
from conftest import tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def jsonl_scalars(run_dir) -> dict:
    """{(name, step): value} of every number in metrics.jsonl (null = not measured: left out)."""
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(k, l["step"]): v for l in lines for k, v in l.items()
            if k != "step" and isinstance(v, (int, float))}


def tensorboard_scalars(run_dir) -> tuple[dict, dict]:
    """({(tag, step): value}, {hparam: value}) from the run folder's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    values = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    return values, hparams


def tensorboard_text_steps(run_dir) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.step for e in acc.Tensors("samples/text_summary")]


def wandb_records(path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log blocks of 32 KiB
    whose records (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) carry a Record."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, pending, records = path.read_bytes(), 7, b"", []
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:                  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:
            break
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_scalars(run_dir) -> tuple[dict, dict]:
    """({(key, step): value}, config) of the offline run under <run>/wandb/."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    values, config = {}, {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {(i.nested_key[0] if i.nested_key else i.key): json.loads(i.value_json) for i in r.history.item}
            values.update({(k, row["_step"]): v for k, v in row.items() if not k.startswith("_")})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update
                           if not i.key.startswith("_")})
    return values, config


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No W&B key anywhere and no network: what a fresh machine has."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


@pytest.mark.skipif(not (importlib.util.find_spec("tensorboard") and importlib.util.find_spec("wandb")),
                    reason="make test installs tensorboard and wandb (requirements-test.txt)")
def test_tensorboard_and_wandb_hold_the_numbers_of_metrics_jsonl(tmp_path, alternating_rewards, offline, capsys):
    model, tokenizer = tiny_policy()
    cfg = tiny_config(tmp_path, report_to="tensorboard,wandb", eval_every=1)
    train.train(cfg, model, tokenizer)
    run = tmp_path / "run"
    expected = jsonl_scalars(run)
    names = {k for k, _ in expected}
    assert {"reward", "llds/loss", "lld/logp_correct", "eval/em", "timing/step"} <= names
    assert {s for _, s in expected} == {0, 1, 2}

    tb, hparams = tensorboard_scalars(run)
    assert tb.keys() == expected.keys()
    assert tensorboard_text_steps(run) == [1, 2]                 # each step's saved episodes
    for key, value in expected.items():                # TensorBoard stores float32
        assert tb[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    assert hparams["lr"] == pytest.approx(cfg.lr) and hparams["name"] == "run" and hparams["llds"] == 1   # bools become numbers

    wb, config = wandb_scalars(run)
    tables = {k: v for k, v in wb.items() if k[0] == "samples"}
    assert set(tables) == {("samples", 1), ("samples", 2)}      # a table of episodes per step (nested keys)
    assert {k: v for k, v in wb.items() if k[0] != "samples"} == expected   # JSON doubles: exactly the same numbers
    assert config["lr"] == cfg.lr and config["report_to"] == "tensorboard,wandb"
    out = capsys.readouterr().out
    assert f"the run goes to {run / 'wandb'}/offline-run-" in out and "upload it with: wandb sync " in out


@pytest.mark.skipif(not importlib.util.find_spec("tensorboard"), reason="make test installs tensorboard")
def test_a_resumed_run_leaves_one_tensorboard_point_per_step(tmp_path, alternating_rewards, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plumbing import checkpoints

    save = checkpoints.save_checkpoint

    def killed_at_step_2(run_dir, step, *args, **kwargs):   # killed after logging step 2, before its checkpoint
        if step == 2:
            raise KeyboardInterrupt
        return save(run_dir, step, *args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_checkpoint", killed_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny_config(tmp_path, report_to="tensorboard"), *tiny_policy())
    monkeypatch.setattr(checkpoints, "save_checkpoint", save)
    run = tmp_path / "run"
    train.train(tiny_config(tmp_path, report_to="tensorboard", resume=True), *tiny_policy())
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward")] == [1, 2] and [e.step for e in acc.Scalars("eval/em")] == [0, 2]
    assert tensorboard_scalars(run)[0] == pytest.approx(jsonl_scalars(run), rel=1e-6, abs=1e-30)


def test_report_to_names_the_missing_package_in_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        train.main(["--out-dir", str(tmp_path), "--report-to", "wandb"])
    assert str(e.value) == "error: --report-to wandb needs the wandb package: pip install wandb==0.31.0"
    with pytest.raises(SystemExit, match="report-to must be none, all, or some of tensorboard,wandb"):
        train.main(["--out-dir", str(tmp_path), "--report-to", "comet"])
    assert not list(tmp_path.iterdir())                # refused before any run folder or model


def test_report_to_values_follow_trl():
    assert run_log.targets("none") == [] and run_log.targets("all") == ["tensorboard", "wandb"]
    assert run_log.targets("tensorboard, wandb") == ["tensorboard", "wandb"]
