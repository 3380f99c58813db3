"""The `edgc` console script: subcommand wiring only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn

from edgc import __version__
from edgc.config import EDGCConfig
from edgc.extras import missing_extra
from edgc.fields import FieldType, field_docs, field_types, table_fields
from edgc.policy.registry import policy_names

# Each command's line in `edgc --help` (`edgc simulate`'s parser, in edgc.bench.simulate,
# has its own copy)
_SHORT_HELP = {
    "train": "train a GPT-2 preset with a gradient-sync method",
    "prepare": "tokenise text files or folders into a training data folder",
    "report": "compare finished runs in a table and overlay plots",
    "bench": "measure methods side by side on an emulated slow-link cluster",
    "simulate": "project per-step DP sync and training time onto a cluster (α–β model)",
}


class _OneLineErrors(argparse.ArgumentParser):
    """`edgc train`'s parser: a bad flag or value ends the command with one line on stderr,
    "edgc train: error: argument --lr: expected a finite number, got 'nan'", and exit
    status 2, without the usage text (`edgc train -h` shows that)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        # (a subcommand's unknown arguments are otherwise reported by the top parser, with its usage)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


class _BoolFlag(argparse.BooleanOptionalAction):
    """--x sets a bool field, --no-x clears it, and --x true|false (as older commands and
    BENCHMARKS.md write it) says which."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string.startswith("--no-"):
            if values is not None:
                raise argparse.ArgumentError(self, "the --no- form takes no value")
            values = False
        setattr(namespace, self.dest, True if values is None else values)


class _Manual(argparse.HelpFormatter):
    """`edgc train -h` as a manual: paragraphs are filled to the terminal's width, but a
    paragraph with indented lines (the examples) is kept as written, and a bool flag reads
    `--x [true|false], --no-x`."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text  # (zero-argument super() does not work inside a generator)
        return "\n\n".join(block if "\n " in block else fill(block, width, indent) for block in text.split("\n\n"))

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _BoolFlag):
            yes, no = action.option_strings
            return f"{yes} [true|false], {no}"
        return super()._format_action_invocation(action)


_TRAIN_DESCRIPTION = """\
Train a GPT-2 preset under DDP with a gradient-sync method, and write a run folder (--out): \
config.json, metrics.jsonl, checkpoint.pt, summary.md and plots. Without torchrun it starts \
--nproc local workers (gloo, or NCCL with a GPU each); under torchrun it joins the job.

EDGC sends every step whole until its warm-up ends: as soon as rank --rank would leave out at \
most a tenth of the gradient's norm (--edgc-warmup gradient, --edgc-warmup-max-error 0.1), and \
at the latest after --edgc-warmup-steps (by default a tenth of --steps; with --pp > 1, always \
then: --edgc-warmup fixed). It then \
compresses at a rank that starts at --rank and falls as the gradient's noise grows \
(--edgc-policy noise; "cqm" is the paper's rule, which follows the gradient's entropy).

Each value is read by its option's type: INT (digits, no 1e3), FLOAT (a finite number), \
TEXT or DIR (as written: --out 2024 is a folder), one of {the,listed,choices}, true|false, or \
null to unset an option whose placeholder ends in |null."""

_TRAIN_EXAMPLES = """\
examples:
  edgc train --steps 300 --out runs/a          EDGC on 2 local workers, GPT-2 tiny, built-in corpus
  edgc train --method none --out runs/b        the same run with plain all-reduce, to compare
  edgc report runs/a runs/b                    compare them in a table and plots
  edgc train --pp 2 --dp 2                     4 workers: 2 pipeline stages x 2 replicas
  edgc train --log tensorboard                 also TensorBoard events in RUN/tensorboard
  edgc train --resume runs/a --steps 600       continue a run from its checkpoint
  edgc train --config run.toml --lr 3e-4       options from a file; flags given here win
  torchrun --nproc-per-node 8 -m edgc train    join a torchrun job"""


def _add_train(sub: argparse._SubParsersAction) -> None:
    from edgc.policy.dac import DACConfig
    from edgc.train.config import TrainConfig

    p = sub.add_parser("train", help=_SHORT_HELP["train"],
                       usage="edgc train [-h] [--config FILE] [--resume RUN | --auto-resume] [--overwrite] "
                             "[--OPTION VALUE ...]",
                       description=_TRAIN_DESCRIPTION, epilog=_TRAIN_EXAMPLES, formatter_class=_Manual)
    p.__class__ = _OneLineErrors  # (argparse has no argument for one subcommand's parser class)
    run = p.add_argument_group("which run")
    run.add_argument("--config", metavar="FILE", type=_path_text,
                     help="TOML or JSON file of training options (an [edgc] table for EDGCConfig, a [dac] table "
                          "for DACConfig, an [expert_edgc] table for the experts'); flags given here win")
    run.add_argument("--resume", metavar="RUN", type=_path_text,
                     help="continue the run in this folder from its checkpoint.pt, or from a checkpoint file in it "
                          "(see --keep-checkpoints), with the settings it was made with")
    run.add_argument("--auto-resume", action="store_true",
                     help="resume --out's run if it has a checkpoint, else start it (for torchrun --max-restarts, "
                          "which reruns the same command)")
    run.add_argument("--overwrite", action="store_true", help="replace the run files in --out of an earlier run")
    # Every option is absent from the namespace unless given, so that an explicit "null"
    # (--stop-after null) reaches the options as None and can clear a saved value.
    for title, names in TrainConfig.GROUPS.items():
        _add_fields(p.add_argument_group(title), TrainConfig, "", "", names)
    group = p.add_argument_group("EDGCConfig fields, as --edgc-FIELD (edgc.config; defaults scaled to the run "
                                 "are given in words)")
    _add_fields(group, EDGCConfig, "edgc-", "edgc__", tuple(f.name for f in dataclasses.fields(EDGCConfig)
                                                           if f.name != "total_steps"),  # (--steps is it)
                shown_defaults=TrainConfig.SCALED_EDGC_DEFAULTS)
    group = p.add_argument_group("DACConfig fields, as --dac-FIELD, with --pp > 1 (edgc.policy.dac)")
    _add_fields(group, DACConfig, "dac-", "dac__")
    group = p.add_argument_group("the experts' own compression, as --expert-edgc-FIELD, with tiny-moe or small-moe "
                                 "under FSDP2 (--ep > 1, --dp-shard or --dp-replicate; any EDGCConfig field in a "
                                 "config file's [expert_edgc] table; docs/moe.md)")
    _add_fields(group, EDGCConfig, "expert-edgc-", "expert_edgc__", EXPERT_FLAGS, same_as="edgc-")


#: The EDGCConfig fields `edgc train` has --expert-edgc-FIELD flags for (TrainConfig.expert_edgc);
#: a config file's [expert_edgc] table takes any field.
EXPERT_FLAGS = ("policy", "max_rank", "min_rank", "rank_step", "warmup", "warmup_steps", "warmup_min_steps",
                "warmup_max_error", "wire", "state_dtype", "use_error_feedback", "warm_start", "noise")


def _add_fields(group, cls: type, flag_prefix: str, dest_prefix: str, names: tuple[str, ...] | None = None,
                shown_defaults: dict[str, str] | None = None, same_as: str | None = None) -> None:
    """One flag --<flag_prefix><field> per field of the config dataclass `cls` (those in
    `names`, by default all), parsed by the field's type (edgc.fields.FieldType.parse),
    with its docstring and default as help, its CHOICES or METAVARS entry as placeholder;
    `shown_defaults` gives a default in words where the run sets it. A section's fields
    (EDGCConfig.noise) have flags --<flag_prefix><section>-<field>, whose dest joins them
    with "_" (the config's flat form, "noise_exponent"). Dict fields (TrainConfig.edgc,
    .dac) have flags of their own and none here. `same_as`: the prefix of flags that set
    the same fields for the whole run, which each flag's help names instead of repeating
    the field's documentation."""
    choices = getattr(cls, "CHOICES", {})
    metavars = getattr(cls, "METAVARS", {})
    docs = field_docs(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    types = field_types(cls)
    for name in names or types:
        ftype = types[name]
        if ftype.kind is dict:
            continue
        if ftype.section:
            inner = None if same_as is None else f"{same_as}{name.replace('_', '-')}-"
            _add_fields(group, ftype.kind, f"{flag_prefix}{name.replace('_', '-')}-", f"{dest_prefix}{name}_",
                        same_as=inner)
            continue
        flag = f"--{flag_prefix}{name.replace('_', '-')}"
        shown = (shown_defaults or {}).get(name) or _shown(defaults[name])
        help_text = f"{_as_typed(docs.get(name, ''))} (default: {shown})".replace("%", "%%")
        if same_as is not None:
            twin = f"--{same_as}{name.replace('_', '-')}"
            help_text = f"{twin} for the experts' gradients (default: the run's {twin})"
        if ftype.kind is bool:
            group.add_argument(flag, dest=dest_prefix + name, action=_BoolFlag, type=_typed(ftype),
                               default=argparse.SUPPRESS, metavar="true|false", help=help_text)
            continue
        if name in choices:
            metavar = "{" + ",".join(choices[name]) + "}"
        elif name in metavars:
            metavar = metavars[name] + ("|null" if ftype.optional else "")
        elif cls is EDGCConfig and name == "policy":
            metavar = "{" + ",".join(policy_names()) + "}"
        else:
            metavar = ftype.metavar
        group.add_argument(flag, dest=dest_prefix + name, type=_typed(ftype), default=argparse.SUPPRESS,
                           metavar=metavar, help=help_text)


# Python's words for a value, as the command line writes them (edgc.config.FieldType.parse)
_TYPED_WORDS = {"None": "null", "True": "true", "False": "false"}
_PYTHON_WORD = re.compile(r"\b(None|True|False)\b")


def _as_typed(text: str) -> str:
    """A field's docstring as help for its flag: Python's None, True and False (whole words
    only) as the command line writes them, null, true and false. The docstrings keep
    Python's words: they are the Python API's documentation too."""
    return _PYTHON_WORD.sub(lambda m: _TYPED_WORDS[m.group(1)], text)


def _path_text(text: str) -> str:
    """A path given on the command line, as written; refuses empty text (which would
    otherwise read as "not given": `--resume ""` started a new run with the defaults)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def _explain(parser: argparse.ArgumentParser) -> None:
    """Bring a command's hand-written parser to `edgc train -h`'s standard: its help laid out
    as a manual (_Manual), INT and FLOAT as placeholders of numbers, and each option's
    default, as the command line writes it, after its help unless the help already gives
    it ("(default: ..."). A None default is left to the help's words."""
    parser.formatter_class = _Manual
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS) or action.nargs == 0:  # (-h and flags: nothing to show)
            continue
        if action.metavar is None and action.choices is None and action.type in (int, float):
            action.metavar = "INT" if action.type is int else "FLOAT"
        if action.default is not None and "(default: " not in action.help:
            action.help += f" (default: {_shown(action.default)})".replace("%", "%%")


def _shown(default: object) -> str:
    """A field's default as the command line writes it: null, true, false, "" or the value."""
    if default is None:
        return "null"
    if isinstance(default, bool):
        return str(default).lower()
    return '""' if default == "" else str(default)


def _typed(ftype: FieldType):
    """The argparse `type` that reads a flag's text as `ftype` says; its error becomes
    argparse's "argument --flag: expected ..., got '...'"."""
    def parse(text: str):
        try:
            return ftype.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _given_options(args: argparse.Namespace) -> dict:
    """The training options this command gives, from --config and the flags (flags win):
    TrainConfig fields, with "edgc", "dac" and "expert_edgc" dicts of EDGCConfig / DACConfig
    fields.
    A flag given as null is there as None (it unsets the option, or a resumed run's value)."""
    from edgc.train.config import TrainConfig, load_config_file

    values: dict = load_config_file(args.config, tables=table_fields(TrainConfig)) if args.config else {}
    tables = {name: dict(values.pop(name, {})) for name in table_fields(TrainConfig)}
    fields = set(field_types(TrainConfig))
    # (a field's flag is in `args` only when given; the rest of `args` is not an option: --resume,
    # -v; a table's flags have dests "<table>__<field>")
    for key, value in vars(args).items():
        table, joined, name = key.partition("__")
        if joined and table in tables:
            tables[table][name] = value
        elif key in fields:
            values[key] = value
    return {**values, **tables}


def _train(args: argparse.Namespace) -> int:
    from edgc.train.config import TrainConfig
    from edgc.train.summary import load_run, show_table, summarize
    from edgc.train.trainer import (
        CHECKPOINT_NAME,
        RunDiverged,
        resume_config,
        resume_target,
        train,
        train_distributed,
    )

    given = _given_options(args)
    if args.resume and args.auto_resume:
        raise ValueError("give --resume RUN or --auto-resume (with --out), not both")
    resume = resume_target(args.resume) if args.resume else None
    if args.auto_resume:
        folder = Path(given.get("out") or TrainConfig.out)
        resume = folder / CHECKPOINT_NAME if (folder / CHECKPOINT_NAME).is_file() else None
    if resume is not None:
        cfg = resume_config(resume, given)
    else:
        cfg = TrainConfig.from_dict(given)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    start = train_distributed if under_torchrun else train
    diverged = None
    try:
        # (--auto-resume without a checkpoint yet: a restarted job replaces its own first attempt)
        run = start(cfg, resume=resume, overwrite=args.overwrite or (args.auto_resume and resume is None))
    except RunDiverged as exc:  # (what it wrote is kept: shown as a finished run's, then the error, exit 1)
        run, diverged = exc.run, exc
    if not under_torchrun or os.environ.get("RANK") == "0":
        print(f"run folder: {run}  ({', '.join(_written(run))})", flush=True)
        config, records = load_run(run)
        show_table([summarize(run.name, config, records)])
    if diverged is not None:
        raise diverged
    return 0


def _written(run: Path) -> list[str]:
    """Which of a run's outputs its folder holds, as the run folder line lists them: some
    of summary.md, metrics.jsonl, plots and checkpoint.pt (a diverged run may have none)."""
    from edgc.train.checkpoint import CHECKPOINT_NAME

    listed = {"summary.md": "summary.md", "metrics.jsonl": "metrics.jsonl", "loss.png": "plots",
              CHECKPOINT_NAME: CHECKPOINT_NAME}
    return [shown for name, shown in listed.items() if (run / name).is_file()]


_PREPARE_EXAMPLES = """\
examples:
  edgc prepare ~/texts/ --out data/mine --tokenizer gpt2          the GPT-2 BPE
  edgc prepare a.txt more/ --out data/mine2 --tokenizer bpe       a local BPE trained on them
  edgc train --data data/mine                                     train on the folder"""


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help=_SHORT_HELP["prepare"],
                       description="Tokenise text files into a data folder for edgc train --data: train.bin and "
                                   "val.bin (split by file), meta.json, and a BPE's tokenizer.json. Near-duplicate "
                                   "files are left out (it prints how many).",
                       epilog=_PREPARE_EXAMPLES)
    p.add_argument("paths", nargs="+", help="text files or folders (searched recursively)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (train.bin, val.bin, meta.json)")
    p.add_argument("--tokenizer", default="gpt2",
                   help='"gpt2", "bpe" (train a byte-level BPE on the train split) or a saved BPE tokenizer.json')
    p.add_argument("--vocab-size", type=int, default=2048, help='size of the BPE trained with --tokenizer bpe')
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out for validation")
    p.add_argument("--keep-duplicates", action="store_true",
                   help="keep near-duplicate files (by default the first of each family of files whose "
                        "word 5-gram Jaccard similarity is >= 0.7 is kept and the rest left out)")
    _explain(p)


def _prepare(args: argparse.Namespace) -> int:
    from edgc.data import prepare_files

    prepared = prepare_files(args.paths, args.out, args.tokenizer, args.val_fraction, args.vocab_size,
                             keep_duplicates=args.keep_duplicates)
    meta = json.loads((Path(args.out) / "meta.json").read_text())
    print(f"{args.out}: {prepared.train_tokens:,} train / {prepared.val_tokens:,} validation tokens "
          f"({meta['train_files']} / {meta['val_files']} files), tokenizer {args.tokenizer}")
    if not args.keep_duplicates:
        print(f"left out {len(prepared.duplicates)} near-duplicate file(s) (keep them with --keep-duplicates)")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help=_SHORT_HELP["report"],
                       description="Compare runs of edgc train: a table of their final validation loss (± its "
                                   "standard error), bytes sent and times, against the first run, in report.md "
                                   "and in the terminal, and their curves overlaid in plots.",
                       epilog="example:\n  edgc report runs/a runs/b --out runs/report")
    p.add_argument("runs", nargs="+", help="run folders")
    p.add_argument("--out", default="runs/report", metavar="DIR", help="where report.md and the plots go")
    _explain(p)


def _report(args: argparse.Namespace) -> int:
    from edgc.train.report import report
    from edgc.train.summary import show_table

    show_table(report(args.runs, args.out))
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from edgc.bench import comm, pareto, soak, train

    p = sub.add_parser("bench", help=_SHORT_HELP["bench"],
                       description="Measure the gradient-sync methods side by side. comm, train and pareto run "
                                   "each worker in its own network namespace with tc-limited links (root and "
                                   "iproute2; --loopback, or for pareto no --bandwidth, runs on 127.0.0.1 "
                                   "instead); soak runs local gloo workers. edgc bench KIND -h for each.")
    kinds = p.add_subparsers(dest="bench", required=True, metavar="KIND")
    for module in (comm, train, pareto, soak):
        module.add_parser(kinds)
    for parser in kinds.choices.values():
        _explain(parser)


def _bench(args: argparse.Namespace) -> int:
    from edgc.bench import comm, pareto, soak, train

    return {"comm": comm.run, "train": train.run, "pareto": pareto.run, "soak": soak.run}[args.bench](args)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from edgc.bench import simulate

    simulate.add_parser(sub)
    _explain(sub.choices["simulate"])


def _simulate(args: argparse.Namespace) -> int:
    from edgc.bench import simulate

    return simulate.run(args)


COMMANDS = {
    "train": (_add_train, _train),
    "prepare": (_add_prepare, _prepare),
    "report": (_add_report, _report),
    "bench": (_add_bench, _bench),
    "simulate": (_add_simulate, _simulate),
}

# The extra (edgc.extras) each command needs installed. Without it the command's own
# parser, which imports the command's modules, is not built: `edgc --help` lists it with
# the extra to install, and main() ends it with one line saying so.
NEEDS_EXTRA = dict.fromkeys(COMMANDS, "train")


def _missing_extra(command: str) -> str | None:
    """None when `command`'s extra is installed, else the one line that says which to install."""
    return missing_extra(f"edgc {command}", NEEDS_EXTRA[command])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgc",
                                     description="Entropy-driven dynamic gradient compression for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"edgc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, _) in COMMANDS.items():
        if _missing_extra(name) is None:
            add(sub)
        else:  # (listed in the help; main() stops the command before parsing its arguments)
            sub.add_parser(name, add_help=False,
                           help=f"{_SHORT_HELP[name]} (needs: pip install 'edgc[{NEEDS_EXTRA[name]}]')")
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names: its first word that is not an option (edgc's own
    options, -v, --version and -h, take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    if command in COMMANDS:
        needs = _missing_extra(command)
        if needs is not None:  # (one line, before any of the command's modules is imported)
            print(needs, file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command][1](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"edgc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"edgc {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line for the user; the traceback goes to a log file
        from edgc.train.launch import WorkerError
        from edgc.train.trainer import TrainingFailed

        if isinstance(exc, (TrainingFailed, WorkerError)):  # (already one line, tracebacks logged)
            print(f"edgc {args.command}: error: {exc}", file=sys.stderr)
            return 1
        log = _crash_log(args, traceback.format_exc())
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"edgc {args.command}: error: {type(exc).__name__}: {first} (traceback in {log})", file=sys.stderr)
        return 1


def _crash_log(args: argparse.Namespace, text: str) -> Path:
    """Append a traceback to the run folder's errors.log (train), else, or when that
    cannot be written (a read-only folder), to a file in the temporary folder; returns
    its path."""
    folder = getattr(args, "resume", None) or getattr(args, "out", None)
    if folder and Path(folder).is_file():  # (--resume FILE)
        folder = Path(folder).parent
    paths = [Path(tempfile.gettempdir()) / f"edgc-error-{os.getpid()}.log"]
    if args.command == "train" and folder and Path(folder).is_dir():
        paths.insert(0, Path(folder) / "errors.log")
    for path in paths:
        try:
            with open(path, "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} edgc {args.command}\n{text}\n")
            break
        except OSError:
            continue
    return path


if __name__ == "__main__":
    sys.exit(main())
