"""A configuration dataclass -> argparse flags: every field becomes `--field-name` (booleans get
`--no-` too), and the comment after the field in the source is its --help text; and the checks
of train.py's settings that end in one clear error."""
import argparse
import dataclasses
import inspect
import re

import torch

from llds import GATES, REDUCTIONS


def field_help(config_class) -> dict[str, str]:
    """{field: the comment after it in the class's source}."""
    return dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.+)$", inspect.getsource(config_class), re.M))


def add_config_flags(parser: argparse.ArgumentParser, config_class) -> None:
    """One flag per field of `config_class`; unset flags stay out of the parsed namespace, so
    a preset can fill them and explicit flags override the preset."""
    helps = field_help(config_class)
    for f in dataclasses.fields(config_class):
        flag = "--" + f.name.replace("_", "-")
        text = f"{helps.get(f.name, '')} (default: {f.default})"
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(flag, type=f.type, default=argparse.SUPPRESS, metavar=f.type.__name__.upper(),
                                help=text)


def check_config(cfg) -> None:
    """Catch inconsistent train.py settings before any model is loaded (ValueError with what to change)."""
    batch = cfg.prompts_per_step * cfg.group_size
    if min(cfg.steps, cfg.prompts_per_step, cfg.group_size, cfg.mini_batch_size, cfg.micro_batch_size) < 1:
        raise ValueError("steps, prompts-per-step, group-size, mini-batch-size and micro-batch-size must be >= 1")
    if cfg.group_size < 2:
        raise ValueError("group-size must be >= 2: GRPO compares the rollouts of one question")
    if batch % cfg.mini_batch_size:
        raise ValueError(f"mini-batch-size {cfg.mini_batch_size} must divide prompts-per-step x group-size = {batch}")
    if cfg.max_prompt_tokens >= cfg.max_context:
        raise ValueError(f"max-prompt-tokens {cfg.max_prompt_tokens} must be below max-context {cfg.max_context}")
    if cfg.llds_gate not in GATES:
        raise ValueError(f"llds-gate must be one of {', '.join(GATES)}, not {cfg.llds_gate!r}")
    if cfg.llds_reduction not in REDUCTIONS:
        raise ValueError(f"llds-reduction must be one of {', '.join(REDUCTIONS)}, not {cfg.llds_reduction!r}")
    if cfg.answer_weight != "adaptive":
        try:
            float(cfg.answer_weight)
        except ValueError:
            raise ValueError(f"answer-weight must be a number or 'adaptive', not {cfg.answer_weight!r}") from None
    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, not {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no GPU; use --device cpu")
