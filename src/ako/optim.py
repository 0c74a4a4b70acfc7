"""The optimizer and learning-rate schedule of a run, on one flat parameter vector.

ako steps one tensor: a replica's flat parameters (numel,) or a parameter server's shard of
them. Any `torch.optim.Optimizer` that steps without a closure does, built by name
(`--optimizer adamw`, OPTIMIZERS) or by the user's `optimizer_fn(params) -> Optimizer`, with a
`torch.optim.lr_scheduler` schedule stepped once per optimizer step wherever the optimizer runs
(`--lr-schedule`, or the user's `scheduler_fn(optimizer) -> LRScheduler`).

The optimizer sees the whole vector as one tensor, so an elementwise optimizer (SGD, Adam,
AdamW, Adadelta, ...) behaves exactly as on the model's own tensors, and its steps on shards
equal one step on the whole vector. An optimizer that looks at a tensor as a whole (LARS,
LAMB, Adafactor, Muon) sees one tensor; the strategies whose servers step shards
(`Strategy.optimizer_on == "servers"`) refuse it (`check_elementwise`).

Defaults: for `sgd`, ako's (lr 0.1, momentum 0.9, Nesterov, weight decay 5e-4); for the others,
torch's own (Adam's lr 1e-3, ...). `--lr-scaling linear` multiplies the learning rate by the
number of workers (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.1), `sqrt` by
its square root; `auto` (the default) takes `sqrt` where the model moves by the mean of the
workers' own adaptive steps (`lr_factor`), else none. Where the workers step on stale
parameters (ssp, asp, ako out of lock-step), an optimizer with `betas` (Adam, AdamW, ...) takes beta1 STALE_BETA1
unless `--optimizer-arg betas=` is given (`stale_betas`).
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim import lr_scheduler

from ako.checks import ConfigError, show
from ako.interrupts import held

OptimizerFn = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
SchedulerFn = Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adadelta": torch.optim.Adadelta,
    "adagrad": torch.optim.Adagrad, "adamax": torch.optim.Adamax, "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam, "rmsprop": torch.optim.RMSprop, "rprop": torch.optim.Rprop, "asgd": torch.optim.ASGD,
}  # fmt: skip
SCHEDULES = ("constant", "step", "cosine", "linear")
LR_SCALINGS = ("auto", "none", "linear", "sqrt")
SGD_DEFAULTS = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
STALE_BETA1 = 0.5  # beta1 where the workers' steps are stale (`stale_betas`; measured in docs/results.md)
_NOT_SETTABLE = {"params", "self", "foreach", "fused", "capturable", "differentiable"}  # how, not what


def optimizer_settings(name: str) -> dict[str, object]:
    """The hyper-parameters optimizer `name` takes, with torch's defaults (ako's for sgd)."""
    params = inspect.signature(OPTIMIZERS[name].__init__).parameters
    settings = {k: p.default for k, p in params.items() if k not in _NOT_SETTABLE}
    return {**settings, **SGD_DEFAULTS} if name == "sgd" else settings


def optimizer_kwargs(config) -> dict[str, object]:
    """The keyword arguments of the configured optimizer: `lr`, `momentum`, `nesterov`,
    `weight_decay` where set (ako's defaults for sgd, torch's otherwise), then
    `optimizer_args`. Raises ConfigError for a setting the optimizer does not take."""
    allowed = optimizer_settings(config.optimizer)
    kwargs = {k: v for k, v in SGD_DEFAULTS.items() if config.optimizer == "sgd"}
    for name in ("lr", "momentum", "nesterov", "weight_decay"):
        value = getattr(config, name)
        if value is None:
            continue
        if name not in allowed:
            if value is False:  # --no-nesterov: off is what an optimizer without it does anyway
                continue
            raise ConfigError(f"{name} {show(value)}: optimizer {config.optimizer} has no such setting "
                              f"(it takes {', '.join(allowed)})")  # fmt: skip
        kwargs[name] = value
    for key, value in (config.optimizer_args or {}).items():
        if key in ("lr", "momentum", "nesterov", "weight_decay"):
            raise ConfigError(f"optimizer_args {key!r}: give it as --{key.replace('_', '-')} (a setting of its own)")
        if key not in allowed:
            raise ConfigError(f"optimizer_args {key!r} (--optimizer-arg): optimizer {config.optimizer} takes {', '.join(allowed)}")
        kwargs[key] = _checked(config.optimizer, key, value, allowed[key])
    if kwargs.get("nesterov") and not kwargs.get("momentum"):
        kwargs["nesterov"] = False  # Nesterov is a form of momentum: nothing to do without it
    return kwargs


def _checked(optimizer: str, key: str, value, default):
    """`value` for setting `key`, whose default is `default`, if it is of that kind (a bool for
    a bool, a finite number for a number, as many numbers for a tuple). Raises ConfigError."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok, kind = number(value), "a finite number"
    elif isinstance(default, tuple):
        ok = isinstance(value, (list, tuple)) and len(value) == len(default) and all(number(x) for x in value)
        kind, value = f"{len(default)} numbers, like {','.join(map(str, default))}", tuple(value) if ok else value
    else:
        ok, kind = True, ""
    if not ok:
        raise ConfigError(f"optimizer_args {key} {show(value)} (--optimizer-arg): {optimizer}'s {key} is {kind}")
    return value


@dataclass(frozen=True)
class Optimization:
    """How to build a run's optimizer and schedule for any flat vector (picklable: it travels
    to every worker and server with the job).

    config: the run's TrainConfig (optimizer, lr, lr_schedule, warmup, ...). steps: optimizer
    steps the schedule spans (the run's planned steps). optimizer_fn/scheduler_fn: the user's,
    in place of the configured ones."""

    config: object
    steps: int
    optimizer_fn: OptimizerFn | None = None
    scheduler_fn: SchedulerFn | None = None
    averages_own_steps: bool = False  # the strategy's (`Strategy.averages_own_steps`), for lr_scaling auto
    stale_steps: bool = False  # the strategy's (`Strategy.stale_steps`), for `stale_betas`

    @property
    def base_lr(self) -> float | None:
        """The configured learning rate after the scaling rule (None with an optimizer_fn)."""
        if self.optimizer_fn is not None:
            return None
        lr = optimizer_kwargs(self.config).get("lr", optimizer_settings(self.config.optimizer)["lr"])
        return lr * lr_factor(self.config, self.averages_own_steps)

    def build(self, params: torch.Tensor) -> FlatOptimizer:
        """An optimizer (with its schedule) stepping `params` (numel,), in place: a leaf
        tensor or a view of one (a server's shard)."""
        kwargs = None
        if self.optimizer_fn is not None:
            optimizer = self.optimizer_fn([params])
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer_fn returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        else:
            kwargs = {**optimizer_kwargs(self.config), **stale_betas(self.config, self.stale_steps), "lr": self.base_lr}
            optimizer = OPTIMIZERS[self.config.optimizer]([params], **kwargs)
        if self.scheduler_fn is not None:
            scheduler = self.scheduler_fn(optimizer)
            if not isinstance(scheduler, lr_scheduler.LRScheduler):
                raise TypeError(f"scheduler_fn returned {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler"
                                " (ReduceLROnPlateau, which needs a metric, is not one)")  # fmt: skip
            return FlatOptimizer(params, optimizer, scheduler)
        return FlatOptimizer(params, optimizer, self.schedule(optimizer), rebuild=self.schedule, settings=kwargs)

    def schedule(self, optimizer: torch.optim.Optimizer):
        """The configured schedule of `optimizer` over this run's steps."""
        return schedule(optimizer, self.config, self.steps)


def lr_factor(config, averages_own_steps: bool) -> float:
    """What `config.lr_scaling` multiplies the learning rate by, for n workers: n (linear),
    sqrt(n) (sqrt), 1 (none); auto: sqrt(n) where the strategy `averages_own_steps` and the
    optimizer is adaptive (not sgd), else 1. Why: an adaptive step is normalised by the
    gradient's own noise, so in the noise-dominated regime each worker's step on a batch of
    B / n has the same length as one on the mean of n such batches, but a noisier direction,
    and the mean of n of them is up to sqrt(n) shorter than the step on the mean gradient that
    the learning rate was set for (`allreduce`). Measured on the gpt (docs/results.md,
    "Language models")."""
    n = config.workers
    if config.lr_scaling == "auto":
        return math.sqrt(n) if averages_own_steps and config.optimizer != "sgd" else 1.0
    return {"linear": n, "sqrt": math.sqrt(n)}.get(config.lr_scaling, 1.0)


def stale_betas(config, stale_steps: bool) -> dict[str, tuple[float, float]]:
    """{"betas": (STALE_BETA1, beta2)} where the strategy's workers take their optimizer steps
    on stale parameters (`stale_steps`: ssp, asp, ako), the optimizer has Adam's `betas` and the
    config gives none (`optimizer_args`); else {}. Why: asynchrony adds a momentum of its own,
    about 1 - 1/n with n workers taking turns, so the optimizer's must be lower for the sum to
    stay where the synchronous one was tuned (Mitliagkas et al., "Asynchrony begets momentum",
    2016; Liu et al. 2018). Measured on the gpt (docs/results.md, "Language models"): asp with
    AdamW's beta1 0.9 ended 0.17 nats above allreduce, with 0.5 level with it; ako 0.15 above,
    with 0.5 below it. sgd's momentum
    is left alone: ssp and asp met their goals with it (experiment 3)."""
    betas = optimizer_settings(config.optimizer).get("betas")
    if not stale_steps or not isinstance(betas, tuple) or "betas" in (config.optimizer_args or {}):
        return {}
    return {"betas": (STALE_BETA1, betas[1])}


def warmup_steps(config, steps_per_epoch: int) -> int:
    """`config.warmup` in optimizer steps: "500" is steps, "0.5epochs" epochs (0 when unset)."""
    if config.warmup is None:
        return 0
    text = str(config.warmup).strip()
    for suffix in ("epochs", "epoch", "ep"):
        if text.endswith(suffix):
            return round(float(text[: -len(suffix)]) * steps_per_epoch)
    return int(text)


def parse_warmup(text) -> str:
    """Check a warm-up length: a number of steps ("500") or of epochs ("0.5epochs")."""
    value = str(text).strip()
    number = value.removesuffix("epochs").removesuffix("epoch").removesuffix("ep")
    try:
        amount = float(number) if number != value else int(number)
    except ValueError:
        raise ConfigError(f"warmup {show(text)}: expected optimizer steps (500) or epochs (0.5epochs)") from None
    if not 0 <= amount <= 1e9:
        raise ConfigError(f"warmup {show(text)}: must be from 0 to 1e9")
    return value


def schedule(optimizer: torch.optim.Optimizer, config, steps: int) -> lr_scheduler.LRScheduler | None:
    """The configured schedule over `steps` optimizer steps: linear warm-up over the first
    `warmup` steps (step k at (k + 1) / warmup of the rate), then constant, step (x lr_gamma
    every lr_decay_epochs), cosine (to 0, Loshchilov & Hutter 2017) or linear (to 0) over the
    rest. None for constant without warm-up."""
    per_epoch = steps / config.epochs if config.epochs else steps
    warm = min(warmup_steps(config, per_epoch), steps)
    rest = max(1, steps - warm)
    if config.lr_schedule == "cosine":
        main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=rest)
    elif config.lr_schedule == "linear":
        main = lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=rest)
    elif config.lr_schedule == "step":
        main = lr_scheduler.StepLR(optimizer, max(1, round(config.lr_decay_epochs * per_epoch)), config.lr_gamma)
    else:
        main = None
    if warm <= 1:
        return main
    warming = lr_scheduler.LinearLR(optimizer, 1.0 / warm, 1.0, total_iters=warm - 1)
    if main is None:
        return warming
    return lr_scheduler.SequentialLR(optimizer, [warming, main], milestones=[warm])


class FlatOptimizer:
    """A torch optimizer and its schedule on one flat vector `params` (numel,): `step(grad)`
    takes the gradient as a tensor of the same shape rather than from `params.grad`.
    `rebuild(optimizer)` makes the schedule anew (the configured ones) and `settings` are the
    configured hyper-parameters: a resumed run then follows its own settings and plan (its
    --lr or --epochs may have changed), fast-forwarded to the saved step."""

    def __init__(self, params: torch.Tensor, optimizer: torch.optim.Optimizer, scheduler=None, rebuild=None,
                 settings: dict | None = None):  # fmt: skip
        self.params, self.optimizer, self.scheduler, self.rebuild = params, optimizer, scheduler, rebuild
        self.settings = settings
        self.steps = 0
        # torch.optim's step imports torch._dynamo (0.7 s) the first time: here, before training
        # starts, so that the first step neither counts it nor falls behind the other workers.
        # Ctrl-C is held meanwhile: that import can swallow it.
        if "torch._dynamo" not in sys.modules:
            with held():
                importlib.import_module("torch._dynamo")

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        """One optimizer step with `grad` (numel,), then one step of the schedule."""
        self.params.grad = grad
        self.optimizer.step()
        self.params.grad = None
        self.steps += 1
        if self.scheduler is not None:
            self.scheduler.step()

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        """Optimizer and schedule state (torch's state dicts) and the steps taken, for a checkpoint."""
        scheduler = None if self.scheduler is None else self.scheduler.state_dict()
        return {"optimizer": self.optimizer.state_dict(), "scheduler": scheduler, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))
        if self.rebuild is not None:
            for group in self.optimizer.param_groups:  # this run's settings and its schedule's start
                group.update(self.settings or {})
                group["lr"] = group["initial_lr"] = (self.settings or {}).get("lr", group.get("initial_lr", group["lr"]))
            self.scheduler = self.rebuild(self.optimizer)
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(self.steps if self.scheduler is not None else 0):
                    self.scheduler.step()
        elif self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def check_elementwise(optimization: Optimization, strategy: str) -> None:
    """Raise ConfigError unless the optimizer's steps on two halves of a vector equal its
    steps on the whole vector (what a strategy whose servers step shards needs), or when
    building or stepping it fails. Three steps on a probe of 64 floats."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(64, generator=generator)
    grads = [torch.randn(64, generator=generator) for _ in range(3)]
    try:
        whole = start.clone()
        halves = [start[:32].clone(), start[32:].clone()]
        optimizers = [optimization.build(v) for v in (whole, *halves)]
        for g in grads:
            optimizers[0].step(g.clone())
            optimizers[1].step(g[:32].clone())
            optimizers[2].step(g[32:].clone())
    except Exception as e:  # a user's optimizer_fn may raise anything
        raise ConfigError(f"optimizer: building or stepping it failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    gap = (whole - torch.cat(halves)).abs().max().item()
    if not gap <= 1e-6 * max(1.0, whole.abs().max().item()) or not math.isfinite(gap):
        raise ConfigError(
            f"optimizer: strategy {strategy} steps it on each server's shard, and it is not elementwise "
            f"(steps on two halves differ from steps on the whole vector by {gap:.3g}); use an elementwise "
            "optimizer (sgd, adam, adamw, ...) or a strategy whose workers run the optimizer"
        )
