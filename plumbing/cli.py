"""A configuration dataclass -> argparse flags. Each field is declared with `flag(default, help,
accepts)`: every field becomes `--field-name` (booleans get `--no-` too), `help` is its --help text
and `accepts` the values it takes, which `check_ranges` enforces and --help shows:

    ">= 1"  "> 0, <= 1"  "0..4294967295"   numbers (floats also finite)
    "choice"   one of the values the script lists for it (its CHOICES)
    "text"     a non-empty string        "file"  "" or an existing file
    "any"      anything the type takes; checked where it is used (a model name, a URL, ...)

Also the checks of train.py's settings that end in one clear error, and an argparse parser whose
errors are one line."""
import argparse
import dataclasses
import math
import operator
import os
import sys
import typing


def flag(default, help: str, accepts: str | None = None):
    """A config field: its default, its --help text and the values it accepts (None for booleans)."""
    return dataclasses.field(default=default, metadata={"help": help, "accepts": accepts})


def field_help(config_class) -> dict[str, str]:
    """{field: its --help text}."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(config_class)}


_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def field_ranges(config_class) -> dict[str, str]:
    """{field: the values it accepts}, e.g. ">= 1", for every field but the booleans; a field
    without them is a programming error (TypeError), so none can be added without a range."""
    types, ranges = typing.get_type_hints(config_class), {}
    for f in dataclasses.fields(config_class):
        if types[f.name] is bool:
            continue
        if not f.metadata.get("accepts"):
            raise TypeError(f"{config_class.__name__}.{f.name} declares no range: "
                            "declare it with flag(default, help, accepts)")
        ranges[f.name] = f.metadata["accepts"]
    return ranges


def _accepts(spec: str, choices) -> str:
    """What a declared range accepts, in words for an error line."""
    if spec == "choice":
        return "one of " + ", ".join(map(str, choices))
    return {"text": "a non-empty string", "file": "an existing file (or empty)"}.get(spec, spec.replace("..", " to "))


def in_range(value, spec: str, choices=()) -> bool:
    """Whether `value` lies in the declared range `spec` (the module docstring lists the forms)."""
    if spec == "any":
        return True
    if spec == "choice":
        return value in choices
    if spec == "text":
        return bool(str(value).strip())
    if spec == "file":
        return value == "" or os.path.isfile(value)
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if ".." in spec:
        low, high = (float(x) for x in spec.split(".."))
        return low <= value <= high
    return all(_COMPARE[op](value, float(bound)) for op, bound in (c.split() for c in spec.split(",")))


def check_ranges(cfg, choices: dict | None = None) -> None:
    """Every field of the dataclass `cfg` inside its declared range, else ValueError naming the flag
    and what it accepts (field_ranges: a non-boolean field without one is a TypeError)."""
    choices = choices or {}
    for name, spec in field_ranges(type(cfg)).items():
        if not in_range(getattr(cfg, name), spec, choices.get(name, ())):
            raise ValueError(f"--{name.replace('_', '-')} must be {_accepts(spec, choices.get(name, ()))}, "
                             f"not {getattr(cfg, name)!r}")


def ranged(spec: str, kind=int, choices=()):
    """An argparse type: the text parsed as `kind`, then held to the declared range `spec`; an error
    names the flag and what it accepts. `.range` keeps the spec (tests/test_flags.py reads it)."""
    def parse(text):
        value = kind(text)              # ValueError: argparse's own "invalid int value: 'x'"
        if not in_range(value, spec, choices):
            raise argparse.ArgumentTypeError(f"must be {_accepts(spec, choices)}, not {text!r}")
        return value
    parse.__name__, parse.range = kind.__name__, spec
    return parse


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, "error: argument --steps: invalid int value: 'x'", exit 2
    (--help still prints the usage)."""

    def error(self, message):
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def add_config_flags(parser: argparse.ArgumentParser, config_class, defaults=None, choices=None) -> None:
    """One flag per field of `config_class`, held to the field's declared range; unset flags stay
    out of the parsed namespace, so a preset (or `defaults`, an instance of the class whose values
    the help shows) fills them and explicit flags override it. choices: {field: its values}."""
    helps, ranges, choices = field_help(config_class), field_ranges(config_class), choices or {}
    types = typing.get_type_hints(config_class)       # real types, also under `from __future__ import annotations`
    for f in dataclasses.fields(config_class):
        flag, kind = "--" + f.name.replace("_", "-"), types[f.name]
        default = f.default if defaults is None else getattr(defaults, f.name)
        accepts = f" [{ranges[f.name]}]" if ranges.get(f.name, "any") not in ("any", "choice") else ""
        text = f"{helps.get(f.name, '')}{accepts} (default: {default})"
        if kind is bool:
            parser.add_argument(flag, default=argparse.SUPPRESS, help=text, action=argparse.BooleanOptionalAction)
            continue
        metavar = "{" + ",".join(choices[f.name]) + "}" if f.name in choices else kind.__name__.upper()
        parser.add_argument(flag, default=argparse.SUPPRESS, help=text, metavar=metavar,
                            type=ranged(ranges[f.name], kind, choices.get(f.name, ())))


def shared_fields(config_class, values: dict) -> dict:
    """The items of `values` whose key is a field of `config_class`."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {k: v for k, v in values.items() if k in names}


def train_parser(config_class, presets: dict, choices: dict) -> argparse.ArgumentParser:
    """train.py's flags: one per Config field, and --preset, --plot, --plot-out."""
    parser = OneLineParser(
        description="GRPO + LLDS training of a Search-R1 agent. Defaults: the CPU demo "
                    "(SmolLM2-135M, toy world, BM25). --preset paper: the paper's settings.")
    parser.add_argument("--preset", choices=sorted(presets), help="start from a named preset")
    parser.add_argument("--plot", nargs="+", metavar="RUN_DIR", type=ranged("text", str),
                        help="draw the curves of one run (RUN_DIR/curves.png) or of several overlaid, and exit")
    parser.add_argument("--plot-out", metavar="PNG", type=ranged("text", str),
                        help="where --plot draws several runs (default: compare.png beside the first)")
    parser.add_argument("--plan", action="store_true",
                        help="print the run's memory plan (weights, optimizer, KV cache, activations, ...) and exit")
    add_config_flags(parser, config_class, choices=choices)
    return parser


def parse_train_args(config_class, presets: dict, choices: dict, argv=None):
    """train.py's flags -> (config, run folders to plot or None, plot output path or None, --plan:
    False, else the preset's name, True without one: the plan of a preset sized for a card is made
    for that card). Explicit flags override the preset."""
    args = vars(train_parser(config_class, presets, choices).parse_args(argv))
    preset, plot, plot_out = args.pop("preset", None), args.pop("plot", None), args.pop("plot_out", None)
    plan = args.pop("plan", False) and (preset or True)
    return config_class(**{**presets.get(preset, {}), **args}), plot, plot_out, plan


NOTES = {"max_turns": "answer-only episodes in training, no search", "eval_max_turns": "answer-only held-out episodes",
         "topk": "every search returns no passages", "lr": "the policy never changes"}


def check_config(cfg, choices: dict[str, tuple[str, ...]]) -> None:
    """Catch inconsistent train.py settings before any model is loaded (ValueError with what to change).
    choices: {field: its allowed values}, given by the script that defines them."""
    check_ranges(cfg, choices)
    for name, note in NOTES.items():        # legal values that surprise: one line each at start
        if getattr(cfg, name) == 0:
            print(f"--{name.replace('_', '-')} 0: {note}")
    batch = cfg.prompts_per_step * cfg.group_size
    if batch % cfg.mini_batch_size:
        raise ValueError(f"mini-batch-size {cfg.mini_batch_size} must divide prompts-per-step x group-size = {batch}")
    if cfg.verl_minibatches and cfg.mini_batch_size % 4:
        raise ValueError("--verl-minibatches splits each mini-batch over the authors' 4 GPUs: "
                         f"mini-batch-size {cfg.mini_batch_size} must be a multiple of 4")
    if cfg.max_prompt_tokens >= cfg.max_context:
        raise ValueError(f"max-prompt-tokens {cfg.max_prompt_tokens} must be below max-context {cfg.max_context}")
    if not cfg.answer_coef >= 0:
        raise ValueError(f"--answer-coef must be a number >= 0 or inf (no LLDS-MA), not {cfg.answer_coef!r}")
    import torch

    from plumbing.run_log import check_report_to

    check_report_to(cfg.report_to)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no GPU; use --device cpu")
