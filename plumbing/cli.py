"""A configuration dataclass -> argparse flags: every field becomes `--field-name` (booleans get
`--no-` too), and the comment after the field in the source is its --help text (train.py's
Config, eval.py's RolloutConfig); and the checks of train.py's settings that end in one clear
error."""
import argparse
import dataclasses
import inspect
import re
import typing

import torch

from plumbing.report import check_report_to


def field_help(config_class) -> dict[str, str]:
    """{field: the comment after it in the class's source}."""
    return dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.+)$", inspect.getsource(config_class), re.M))


def add_config_flags(parser: argparse.ArgumentParser, config_class, defaults=None, **extra) -> None:
    """One flag per field of `config_class`; unset flags stay out of the parsed namespace, so
    a preset (or `defaults`, an instance of the class whose values the help shows) fills them
    and explicit flags override it. extra: {field: more add_argument keywords (choices, type)}."""
    helps = field_help(config_class)
    types = typing.get_type_hints(config_class)       # real types, also under `from __future__ import annotations`
    for f in dataclasses.fields(config_class):
        flag, kind = "--" + f.name.replace("_", "-"), types[f.name]
        default = f.default if defaults is None else getattr(defaults, f.name)
        text = f"{helps.get(f.name, '')} (default: {default})"
        options = ({"action": argparse.BooleanOptionalAction} if kind is bool
                   else {"type": kind, "metavar": kind.__name__.upper()})
        parser.add_argument(flag, default=argparse.SUPPRESS, help=text, **{**options, **extra.get(f.name, {})})


def shared_fields(config_class, values: dict) -> dict:
    """The items of `values` whose key is a field of `config_class`."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {k: v for k, v in values.items() if k in names}


def parse_train_args(config_class, presets: dict, argv=None):
    """train.py's flags -> (config, run folders to plot or None, plot output path or None).
    Explicit flags override the preset."""
    parser = argparse.ArgumentParser(
        description="GRPO + LLDS training of a Search-R1 agent. Defaults: the CPU demo "
                    "(SmolLM2-135M, toy world, BM25). --preset paper: the paper's settings.")
    parser.add_argument("--preset", choices=sorted(presets), help="start from a named preset")
    parser.add_argument("--plot", nargs="+", metavar="RUN_DIR",
                        help="draw the curves of one run (RUN_DIR/curves.png) or of several overlaid, and exit")
    parser.add_argument("--plot-out", metavar="PNG",
                        help="where --plot draws several runs (default: compare.png beside the first)")
    add_config_flags(parser, config_class)
    args = vars(parser.parse_args(argv))
    preset, plot, plot_out = args.pop("preset", None), args.pop("plot", None), args.pop("plot_out", None)
    return config_class(**{**presets.get(preset, {}), **args}), plot, plot_out


def check_config(cfg, choices: dict[str, tuple[str, ...]]) -> None:
    """Catch inconsistent train.py settings before any model is loaded (ValueError with what to change).
    choices: {field: its allowed values}, given by the script that defines them."""
    batch = cfg.prompts_per_step * cfg.group_size
    if min(cfg.steps, cfg.prompts_per_step, cfg.group_size, cfg.mini_batch_size, cfg.micro_batch_size) < 1:
        raise ValueError("steps, prompts-per-step, group-size, mini-batch-size and micro-batch-size must be >= 1")
    if cfg.group_size < 2:
        raise ValueError("group-size must be >= 2: GRPO compares the rollouts of one question")
    if batch % cfg.mini_batch_size:
        raise ValueError(f"mini-batch-size {cfg.mini_batch_size} must divide prompts-per-step x group-size = {batch}")
    if cfg.max_prompt_tokens >= cfg.max_context:
        raise ValueError(f"max-prompt-tokens {cfg.max_prompt_tokens} must be below max-context {cfg.max_context}")
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                             f"not {getattr(cfg, name)!r}")
    if cfg.answer_weight != "adaptive":
        try:
            float(cfg.answer_weight)
        except ValueError:
            raise ValueError(f"answer-weight must be a number or 'adaptive', not {cfg.answer_weight!r}") from None
    check_report_to(cfg.report_to)
    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, not {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no GPU; use --device cpu")
