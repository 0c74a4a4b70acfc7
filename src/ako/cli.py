"""`ako train | simulate | run | sweep | report | calibrate | generate | info`: parse, validate, call the API. Bad input: one line,
exit status 2."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import tomllib
from typing import NoReturn

from ako.interrupts import held

# Until the imports below are done (torch loads: the first 1 to 3 s of `ako ...`), Ctrl-C and
# SIGTERM are noted rather than acted on (`ako.interrupts`); `main` acts on them.
with held(deliver=False) as _HELD:
    from ako.config import FIELDS, STRATEGIES, ConfigError, TrainConfig, load_toml, option_users, run_config, validate
    from ako.optim import OPTIMIZERS, SCHEDULES
    from ako.runtime.distributed.launcher import terminate_on_sigterm
    from ako.strategies import STRATEGIES as REGISTRY

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump) with exit status 2."""

    def error(self, message):
        raise ConfigError(message)


def _strategy_flags() -> dict:
    """The flags of the strategies' own options, each with the help of every strategy that
    declares it (`ako.strategies.base.Option`), in registry order."""
    helps: dict[str, dict[str, list[str]]] = {}
    for name, strategy in REGISTRY.items():
        for option in strategy.options:
            helps.setdefault(option.name, {}).setdefault(option.help, []).append(name)
    flags = {name: "; ".join(f"{', '.join(users)}: {text}" for text, users in by_help.items()) for name, by_help in helps.items()}
    flags["bandwidth"] += "; simulate: every node's up- and downlink rate, for every strategy (default: free)"
    return {name: (text, {}) for name, text in flags.items()}


# flag -> (help, argparse keywords); every flag maps to the TrainConfig field of the same name
_FLAGS = {
    "strategy": (f"synchronisation strategy: {', '.join(STRATEGIES)}", {}),
    "workers": ("number of workers (under torchrun: the world size less --servers)", {}),
    "dataset": ("fashion-mnist, mnist, digits, auto (fashion-mnist if found, else digits); text: fortunes (Debian's "
                "fortunes) or text:PATH (a UTF-8 file, or a folder of .txt files); or your own as "
                "package.module:factory (a function returning the train and test sets)", {}),
    "data_dir": ("directory with the IDX files (else $AKO_DATA_DIR, else /usr/share/datasets/<name>)", {}),
    "train_samples": ("use only the first N training examples", {}),
    "test_samples": ("use only the first N test examples", {}),
    "model": ("mlp, cnn, resnet (images), gpt (text), or your own as package.module:factory (a function returning "
              "an nn.Module)", {}),
    "context": ("text: tokens per sequence (a sample), and the gpt's context", {}),
    "layers": ("gpt: transformer blocks", {}),
    "heads": ("gpt: attention heads", {}),
    "width": ("gpt: embedding width (a multiple of --heads)", {}),
    "dropout": ("gpt: dropout rate", {}),
    "batch_size": ("mini-batch size per worker (per micro-batch with --accumulate)", {}),
    "accumulate": ("micro-batches per optimizer step (gradient accumulation)", {}),
    "num_workers": ("data-loading processes per worker (as DataLoader's num_workers)", {}),
    "precision": ("fp32, bf16 (autocast) or fp16 (autocast and a loss scale; CUDA only)", {}),
    "optimizer": (f"a torch.optim optimizer: {', '.join(OPTIMIZERS)}", {}),
    "optimizer_args": ("another setting of the optimizer, e.g. betas=0.9,0.95 or eps=1e-6; repeatable",
                       {"action": "append", "metavar": "KEY=VALUE"}),
    "lr": ("learning rate of the averaged gradient, for every strategy, before --lr-scaling (default: 0.1 for sgd, "
           "else torch's)", {}),
    "momentum": ("momentum of sgd or rmsprop (default: 0.9 for sgd)", {}),
    "nesterov": ("Nesterov momentum of sgd (default: on)", {"action": argparse.BooleanOptionalAction}),
    "weight_decay": ("weight decay (default: 5e-4 for sgd, else torch's)", {}),
    "lr_schedule": ("learning-rate schedule, stepped every optimizer step: constant, step, cosine or linear", {}),
    "warmup": ("linear warm-up of the learning rate: optimizer steps (500) or epochs (0.5epochs)", {}),
    "lr_scaling": ("linear: multiply the learning rate by the number of workers (Goyal et al. 2017); sqrt: by its "
                   "square root; none; or auto: sqrt where the workers' own adaptive steps are averaged (gossip, "
                   "easgd, ssp, asp with an optimizer other than sgd), else none", {}),
    "lr_gamma": ("step schedule: multiply the learning rate by this", {}),
    "lr_decay_epochs": ("step schedule: every this many epochs", {}),
    "epochs": ("stop after this many epochs (may be fractional)", {}),
    "max_time": ("stop after this many seconds of training", {}),
    "target_accuracy": ("stop when rank 0's test accuracy reaches this fraction, e.g. 0.85", {}),
    "target": ("stop when an evaluated metric passes a bound, e.g. loss<=0.3 or accuracy>=0.9", {}),
    "loss_fn": ("your training loss, package.module:function (model, batch) -> loss (default: cross-entropy)", {}),
    "eval_fn": ("your evaluation, package.module:function (model, batch) -> {metric: value} (default: loss, accuracy)", {}),
    "collate_fn": ("your collate function, package.module:function (list of samples) -> batch", {}),
    "eval_every": ("evaluate every this many epochs", {}),
    **_strategy_flags(),
    "straggler": (
        "slow a worker: rank=R,factor=K (always) or prob=P,factor=K (any worker, per step); repeatable",
        {"action": "append"},
    ),
    "timeout": ("seconds any wait may take: a worker silent that long is dropped where the strategy goes on without it "
                f"({', '.join(s.name for s in REGISTRY.values() if s.survives_loss)}; ako on all-to-all only), else the run fails", {}),
    "seed": ("random seed (model initialisation and data order)", {}),
    "backend": ("auto (nccl with CUDA, else gloo), gloo or nccl", {}),
    "out_dir": ("where run directories are made", {}),
}


# `ako simulate` takes the train flags and these (config.SIMULATE_OPTIONS)
_SIMULATE_FLAGS = {
    "latency": ("latency added to every message, e.g. 100us or 1ms (default: 0)", {}),
    "seconds_per_sample": ("forward+backward seconds per sample of one worker (default: --profile's, else measured)", {}),
    "profile": ("cluster profile written by ako calibrate (compute speed)", {}),
}


# `ako train` only (config.TRAIN_OPTIONS)
_TRAIN_FLAGS = {
    "checkpoint_every": ("write a checkpoint every this much training time, e.g. 30s or 5min (default: never)", {}),
    "resume": ("continue the run in this run directory from its last complete checkpoint (its config.toml, "
               "then these flags)", {"metavar": "RUN_DIR"}),
}  # fmt: skip


def _add_flags(command: argparse.ArgumentParser, flags: dict) -> None:
    for name, (text, extra) in flags.items():
        default = FIELDS[name].default
        shown = "" if default is None or extra else f" (default: {default})"
        flag = "--optimizer-arg" if name == "optimizer_args" else "--" + name.replace("_", "-")
        command.add_argument(flag, dest=name, default=None, help=text + shown, **extra)


def build_parser() -> argparse.ArgumentParser:
    """The `ako` argument parser; every train flag defaults to None so that a config file can fill it."""
    parser = _Parser(prog="ako", description="Data-parallel training without parameter-server bottlenecks.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,simulate,run,sweep,report,calibrate,generate,info}")
    train = commands.add_parser("train", help="train a model on N workers", description="Train a model on N workers.")
    simulate = commands.add_parser(
        "simulate",
        help="run a strategy on a simulated cluster (virtual time, real gradients)",
        description="Run the same strategy programs on a simulated cluster: real gradients, time from a cost model.",
    )
    for command in (train, simulate):
        command.add_argument("--config", metavar="FILE", help="TOML file of settings; flags override it")
        _add_flags(command, _FLAGS)
        command.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: only on a terminal)")
        command.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                             help="also write the evaluations as TensorBoard event files in the run directory")  # fmt: skip
    _add_flags(simulate, _SIMULATE_FLAGS)
    _add_flags(train, _TRAIN_FLAGS)
    calibrate = commands.add_parser(
        "calibrate", help="measure compute seconds per sample here and write a cluster profile",
        description="Time forward and backward here (one thread, as a worker runs) and write a profile for ako simulate --profile.",
    )  # fmt: skip
    _add_flags(calibrate, {k: _FLAGS[k] for k in ("model", "dataset", "data_dir", "context", "layers", "heads", "width")})
    _add_flags(calibrate, {"batch_size": ("mini-batch size to time, as the simulated workers' will be", _FLAGS["batch_size"][1])})
    calibrate.add_argument("--out", metavar="FILE", type=_path, help="where to write the profile (default: <model>-profile.toml)")
    calibrate.add_argument(
        "--processes", type=int, default=1, metavar="N",
        help="also time 2..N processes computing at once: profile this machine as a cluster of N workers sharing its cores",
    )  # fmt: skip
    sweep = commands.add_parser(
        "sweep", help="run an experiment grid from a sweep file (resumable)",
        description="Run every cell of a sweep file's grid (arms x axes x seeds); finished cells are not run again.",
    )  # fmt: skip
    sweep.add_argument("file", metavar="SWEEP.toml", type=_path, help="the sweep file, e.g. experiments/absp-stragglers.toml")
    sweep.add_argument("--out", metavar="DIR", type=_path, help="the sweep directory (default: sweeps/<name>)")
    sweep.add_argument("--jobs", type=_positive, default=1, metavar="N", help="cells run at once, one core each (default 1)")
    sweep.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: only on a terminal)")
    report = commands.add_parser(
        "report", help="plots and a Markdown table from a sweep directory",
        description="Write report.md (the table of time to the target per arm), cells.csv and the plots of a sweep directory.",
    )  # fmt: skip
    report.add_argument("sweep_dir", metavar="SWEEP_DIR", type=_path, help="a directory written by ako sweep")
    report.add_argument("--out", metavar="DIR", type=_path, help="where to write report.md and the plots (default: SWEEP_DIR/report)")
    generate = commands.add_parser(
        "generate", help="print text sampled from a language model a run saved",
        description="Sample text from a run's model.pt (a gpt trained on text), with its vocabulary.json.",
    )  # fmt: skip
    generate.add_argument("run_dir", metavar="RUN_DIR", type=_path, help="a finished run's directory")
    generate.add_argument("--prompt", default="\n", help="text to start from (default: a newline)")
    generate.add_argument("--tokens", type=int, default=200, metavar="N", help="tokens to sample (default 200)")
    generate.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (default 0.8)")
    generate.add_argument("--top-k", type=int, default=20, metavar="K", help="sample among the K likeliest (default 20; 0: all)")
    generate.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    commands.add_parser("info", help="list strategies, models and data sets, and where data is found")
    run = commands.add_parser(
        "run", help="run your own training script (ako.wrap) on N workers, as torchrun would",
        description="Start SCRIPT on N worker processes (and S servers), whose ako.wrap trains with the strategy; "
                    "a failed process is named in one line, and the others go on where the strategy survives a loss.",
        allow_abbrev=False,  # the script's --out is its own, not an abbreviation of ours
    )  # fmt: skip
    _add_flags(run, {k: _FLAGS[k] for k in _RUN_FLAGS})
    _add_flags(run, {k: v for k, v in _FLAGS.items() if k in _strategy_flags() and k != "micro_batch"})
    run.add_argument("--record-every", type=_positive_steps, default=None, metavar="STEPS",
                     help="steps between two records of the synchronisation metrics (default 50)")
    run.add_argument("script", metavar="SCRIPT", type=_path, help="your training script (python SCRIPT ARGS)")
    run.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


# `ako run`'s own flags of TrainConfig (the strategy's options too, but for the partial steps')
_RUN_FLAGS = ("strategy", "workers", "straggler", "timeout", "seed", "out_dir")


def _positive_steps(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return int(text)


def _path(text: str) -> str:
    """An argparse type: a path, not empty ('' would be read as the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a path, not ''")
    return text


def _positive(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"jobs {text!r}: must be an integer from 1 to 256")
    return int(text)


def config_from_args(args: argparse.Namespace, simulated: bool = False) -> TrainConfig:
    """defaults < --resume's config.toml < --config file < flags; validated (for `ako simulate`
    when `simulated`). A `--strategy` other than the file's drops the file's strategy options
    (a run's config.toml records ssp's staleness = 2 and servers = 1: not settings for ako)."""
    values = {}
    if getattr(args, "resume", None) is not None:
        values = load_toml(run_config(args.resume))
    if getattr(args, "config", None) is not None:
        values.update(load_toml(args.config))
    flags = {name: getattr(args, name) for name in FIELDS if getattr(args, name, None) is not None}
    if "strategy" in values and flags.get("strategy", values["strategy"]) != values["strategy"]:  # the file's options go with its strategy
        for name in option_users():
            if not (name == "bandwidth" and simulated):  # the simulator's link rate, for every strategy
                values.pop(name, None)
    for name, given in flags.items():
        values[name] = _settings(given) if name == "optimizer_args" else _none(name, given)
    return validate(TrainConfig(**values), simulated, given=frozenset(flags))


def _settings(pairs: list[str]) -> dict:
    """`--optimizer-arg betas=0.9,0.95 --optimizer-arg amsgrad=true` as a dict, each value read as
    TOML (numbers, true/false in any case, a list with or without its brackets), else kept as text."""
    settings = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"optimizer-arg {pair!r}: expected KEY=VALUE, like betas=0.9,0.95")
        text = text.strip()
        if text.lower() in ("true", "false"):
            text = text.lower()
        if text[:1] in "([" and text[-1:] in ")]":
            text = text[1:-1]
        try:
            value = tomllib.loads(f"v = [{text}]" if "," in text else f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        settings[key.strip()] = value
    return settings


def _none(name: str, value):
    """`--staleness none` etc.: the word none for the settings whose None means something, but
    not for those where none is a choice of its own (`--compress none`: float32, not auto)."""
    nullable = FIELDS[name].default is None and name not in _NONE_IS_A_CHOICE
    return None if nullable and isinstance(value, str) and value.lower() == "none" else value


_NONE_IS_A_CHOICE = {o.name for s in REGISTRY.values() for o in s.options if "none" in (o.choices or ())}


def cmd_info() -> int:
    """`ako info`: strategies, models, and where each data set was found."""
    from ako.data import DATASETS, find_data_dir
    from ako.data.text import FORTUNES_DIR
    from ako.models import MODELS

    print(f"strategies: {', '.join(STRATEGIES)}")
    width = max(map(len, REGISTRY))
    for name, strategy in REGISTRY.items():
        options = ", ".join("--" + o.name.replace("_", "-") for o in strategy.options)
        where = "optimizer on each server's shard (elementwise ones)" if strategy.optimizer_on == "servers" else "optimizer on the workers"
        print(f"  {name:<{width}} {strategy.paper}; {where}" + (f"; options {options}" if options else ""))
    print(f"optimizers: {', '.join(OPTIMIZERS)} (torch.optim); schedules: {', '.join(SCHEDULES)}")
    print(f"models:     {', '.join(MODELS)}, or your own as package.module:factory")
    for name in DATASETS:
        if name in ("fashion-mnist", "mnist"):
            where = find_data_dir(name)
            print(f"data set {name}: {where if where else 'not found'}")
    print("data set digits: bundled with scikit-learn")
    print(f"data set fortunes: {FORTUNES_DIR if os.path.isdir(FORTUNES_DIR) else 'not found'}; text:PATH: any UTF-8 text")
    return 0


def cmd_train(config: TrainConfig) -> int:
    """`ako train`: exit status 0, or 1 when a worker failed (one line naming its rank)."""
    from ako.api import train
    from ako.data import DataError
    from ako.runtime.distributed.launcher import EXPECTED_FAILURES, WorkerFailed, one_line, under_elastic_agent
    from ako.runtime.distributed.mailbox import Dropped

    try:
        result = train(config, keep_saved=False)  # the flags are merged with the saved settings already
    except (ConfigError, DataError):
        raise
    except WorkerFailed as e:
        print(f"ako: {e}", file=sys.stderr)
        return EXIT_FAILED
    except EXPECTED_FAILURES as e:  # this process is a torchrun worker
        if not under_elastic_agent():
            raise
        print(f"ako: worker rank {os.environ.get('RANK')}: {one_line(e)}", file=sys.stderr)
        # Dropped: the others carry on without this worker, and torchrun would stop them all
        # at a failure; so its part of the job ends without one.
        return 0 if isinstance(e, Dropped) else EXIT_FAILED
    return _not_saved(result.summary)


def _not_saved(summary: dict | None) -> int:
    """0, or 1 with one line when the run finished but could not write all its files (a full
    disk: `outcome.publish` recorded them in the summary's `not_saved`)."""
    missing = (summary or {}).get("not_saved")
    if not missing:
        return 0
    print(f"ako: the run finished, but {'; '.join(missing)}", file=sys.stderr)
    return EXIT_FAILED


def cmd_simulate(config: TrainConfig) -> int:
    """`ako simulate`: exit status 0, or 1 when the strategy deadlocked (one line)."""
    from ako.api import simulate

    try:
        result = simulate(config)
    except RuntimeError as e:
        print(f"ako: {e}", file=sys.stderr)
        return EXIT_FAILED
    return _not_saved(result.summary)


def cmd_sweep(file: str, out: str | None, jobs: int, progress: bool | None) -> int:
    """`ako sweep`: 0 when every cell finished, 1 when some failed (listed), 2 for bad input."""
    from pathlib import Path

    from ako.experiments.grid import load_sweep
    from ako.experiments.runner import SweepFailed, run_sweep

    sweep = load_sweep(file)
    where = Path(out or os.path.join("sweeps", sweep.name))
    try:
        failed = run_sweep(sweep, where, jobs, progress)
    except SweepFailed as e:
        raise ConfigError(str(e)) from None
    except KeyboardInterrupt:  # or SIGTERM (`main`): the running cells are stopped
        _say_interrupted(f"; run the same command again to finish {where}")
        return 130
    for cell, line in failed:
        print(f"ako: cell {cell.name} failed: {line} (log: {where / 'cells' / cell.name / 'log.txt'})", file=sys.stderr)
    print(f"ako sweep: {where}: {len(sweep.cells()) - len(failed)} of {len(sweep.cells())} cells finished; "
          f"ako report {where} makes the plots and table")  # fmt: skip
    return EXIT_FAILED if failed else 0


def cmd_report(sweep_dir: str, out: str | None) -> int:
    """`ako report`: write report.md and the PNG plots."""
    from ako.experiments.report import write_report

    path, damaged = write_report(sweep_dir, out)
    for name in damaged:
        print(f"ako report: cell {name} left out: its summary.json or metrics.jsonl cannot be read "
              "(ako sweep runs it again)", file=sys.stderr)  # fmt: skip
    print(f"ako report: {path}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """`ako run SCRIPT ARGS`: the script's processes (`runtime.distributed.scripts`); 0, 1 when
    one failed and the job could not go on (one line), 2 for bad input (the flags, the script)."""
    import json

    from ako.runtime.distributed.scripts import run_script

    given = {name: getattr(args, name) for name in FIELDS if getattr(args, name, None) is not None}
    settings = {name: _none(name, value) for name, value in given.items() if name != "workers"}
    # without --strategy the script's wrap chooses it, and checks that strategy's options
    checked = given if "strategy" in given else {k: v for k, v in given.items() if k in _RUN_FLAGS}
    config = validate(TrainConfig(**{k: _none(k, v) for k, v in checked.items()}), given=frozenset(checked))
    settings.update({name: getattr(config, name) for name in checked if name != "workers"})  # as validated: "2" is 2
    if "strategy" in given and REGISTRY[config.strategy].server is not None:
        settings["servers"] = config.servers  # the launcher starts them (default 1)
    settings.setdefault("out_dir", "runs")
    if args.record_every is not None:
        settings["record_every"] = args.record_every
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script!r}: no such file")
    servers = settings.get("servers") or 0
    if not (isinstance(servers, int) or str(servers).isdigit()):
        raise ConfigError(f"servers {servers!r}: must be an integer from 1 to 1024")
    return run_script(args.script, args.script_args, config.workers, int(servers), json.dumps(settings), config.timeout)


def cmd_generate(args: argparse.Namespace) -> int:
    """`ako generate`: the prompt and the text sampled after it."""
    import torch

    from ako.generate import generate

    torch.set_num_threads(1)  # token by token on a small model: threads only wait on each other (4x slower on 2 busy cores)
    text = generate(args.run_dir, args.prompt, args.tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + text)
    return 0


def cmd_calibrate(config: TrainConfig, out: str | None, processes: int) -> int:
    """`ako calibrate`: measure, write the profile, print it."""
    from ako.api import calibrate

    out = out or f"{config.model}-profile.toml"
    profile = calibrate(config, out, processes)
    line = f"ako calibrate: {config.model} at batch {config.batch_size}: {profile['seconds_per_sample'] * 1e3:.4g} ms/sample on the CPU (1 thread)"
    if "gpu_seconds_per_sample" in profile:
        line += f", {profile['gpu_seconds_per_sample'] * 1e3:.4g} ms/sample on {profile['gpu']}"
    if "shared_seconds_per_sample" in profile:
        shared = "/".join(f"{t * 1e3:.3g}" for t in profile["shared_seconds_per_sample"])
        line += f", {shared} ms/sample with 1..{processes} processes at once"
    print(f"{line}; profile written to {out}")
    return 0


def _negative_values_joined(argv: list[str]) -> list[str]:
    """`--flag -5MB` as `--flag=-5MB`: argparse takes a value that starts with "-" for an
    option unless it is a plain number, and no option starts with a digit."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-[\d.]", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _say_interrupted(more: str = "") -> None:
    """The line that ends an interrupted command; on a terminal on a line of its own (a
    progress bar, or ^C, may have left the cursor half-way along one)."""
    print(f"{chr(10) if sys.stderr.isatty() else ''}ako: interrupted{more}", file=sys.stderr)


def console() -> NoReturn:
    """The `ako` console script and `python -m ako` (through `ako.__main__`): `main`, then exit
    with its status (1 when stdout's reader left early, without a traceback).
    Ctrl-C and SIGTERM are ignored from then on: the command is done, and Python's exit would
    otherwise end killed by the signal, without a word."""
    try:
        code = main()
        if sys.stdout is not None:  # None when started with stdout closed
            sys.stdout.flush()
    except BrokenPipeError:  # `ako info | head -1`: the reader left; Python's exit would flush again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_FAILED
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """The command line (`argv`, else sys.argv): returns the exit status (2 for bad input, 130
    on Ctrl-C or SIGTERM, which stop every command alike: a run keeps the metrics it has logged)."""
    if _HELD:  # Ctrl-C or SIGTERM while this module was imported
        _HELD.clear()
        _say_interrupted()
        return 130
    with terminate_on_sigterm():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from ako.data import DataError

    try:
        args = build_parser().parse_args(_negative_values_joined(sys.argv[1:] if argv is None else argv))
        if args.command == "info":
            return cmd_info()
        if args.command == "simulate":
            return cmd_simulate(config_from_args(args, simulated=True))
        if args.command == "sweep":
            return cmd_sweep(args.file, args.out, args.jobs, args.progress)
        if args.command == "report":
            return cmd_report(args.sweep_dir, args.out)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "calibrate":
            return cmd_calibrate(config_from_args(args, simulated=True), args.out, args.processes)
        return cmd_train(config_from_args(args))
    except (ConfigError, DataError) as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # under torchrun, once per machine, not once per worker
            print(f"ako: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as interrupt:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C now would end in a traceback
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run_dir = getattr(interrupt, "run_dir", None)  # a run's: the launcher and the simulator set it
        _say_interrupted(f"; what the run logged is in {run_dir}" if run_dir else "")
        return 130

