"""``vitkit train`` (and ``python train.py``): fit, validate, test or predict with LightningCLI, callable from tests
(:func:`cli_main`).

The config picks the LightningModule by its class path (``model.class_path``: :class:`ImageClassifier`
by default, :class:`Seq2SeqModule` for the encoder-decoder presets) and the data module likewise.

Every output of a run lives under ``trainer.default_root_dir``, by default ``runs/<config name>``:

    <root>/checkpoints/best-*.ckpt, last.ckpt     (vitkit.lit.ModelCheckpoint)
    <root>/logs/version_N/metrics.csv, curves.png, hparams.yaml, config.yaml
    <root>/wandb/                                 (WandbLogger, offline or not)

A config therefore names no paths, and ``--ckpt_path last`` finds the run's own ``last.ckpt``.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import LearningRateMonitor, RichModelSummary
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from lightning.pytorch.callbacks import ModelSummary as LightningSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from vitkit import recipes
from vitkit.builder import checkpoint_preset
from vitkit.errors import UsageError, take_traceback_flag, take_verbose_flag
from vitkit.library_output import quiet
from vitkit.tasks import registry
from vitkit.training.callbacks import AtomicCheckpointIO, ModelCheckpoint, ModelSummary, TrainingCurves, checkpoints_dir
from vitkit.training.flat import flat_of, refuse_flat_checkpoint
from vitkit.training.hparams import read_hparams
from vitkit.training.parts import class_at
from vitkit.training.steps import StepsPerEpoch
from vitkit.training.strategies import settle_interrupted_saves

from .common import usage_error
from .model_args import CLASSIFIER, model_class, nulls_as_mappings, read_config, refuse_flat
from .values import check_values


def _attribute(name: str):
    return lambda datamodule: getattr(datamodule, name, None)


def with_recipes(args: list[str]) -> list[str]:
    """``--config NAME`` (``--config=NAME``, ``-c NAME``) with a recipe's name instead of a path: the packaged
    recipe's file; ``configs/NAME.yaml`` that is not a file in the working folder is that recipe too (said on
    stderr). A value that is neither a file nor a recipe ends the command naming the recipes there are."""
    out = list(args)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag not in ("--config", "-c"):
            continue
        if not eq:
            if i + 1 >= len(out):
                continue
            value = out[i + 1]
        path = Path(value)
        # the source tree's path, from another folder or an installed wheel
        moved = path.parent.name == "configs" and path.suffix in (".yaml", ".yml") and not path.exists()
        if not moved and not recipes.is_name(value):
            continue  # a file, or config content given inline: jsonargparse reads it
        resolved = recipes.find(path.name if moved else value)
        if moved and resolved is not None:
            print(f"note: {value} is not a file here; using the recipe {path.stem} ({resolved})", file=sys.stderr)
        if resolved is None:
            raise UsageError(f"--config {value!r} is neither a file nor a recipe; the recipes are "
                             f"{', '.join(recipes.list_recipes())} (`vitkit recipes` describes them)")
        if eq:
            out[i] = f"{flag}={resolved}"
        else:
            out[i + 1] = str(resolved)
    return out


def given_model_args(args: list[str]) -> set[str]:
    """The module's arguments a command line sets (``--model.recipe.lr 1e-3``, ``--model.init_args.recipe.lr=1e-3``,
    ``--model.model_overrides.depth=6`` -> lr, model_overrides)."""
    out = set()
    for a in args:
        if a.startswith("--model."):
            parts = a[len("--model."):].split("=", 1)[0].split(".")
            parts = parts[1:] if parts[0] == "init_args" else parts
            if parts and parts[0] not in ("class_path", "dict_kwargs"):
                out.add(parts[0])
    return out


def strategy_from_path(path: str) -> Strategy:
    """The Lightning strategy a dotted class path names, built with its defaults."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        names = ", ".join(StrategyRegistry.available_strategies())
        raise UsageError(f"--trainer.strategy {path}: expected a registered strategy name ({names}) or the class "
                         f"path of a Lightning Strategy; {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise UsageError(f"--trainer.strategy {path}: expected a subclass of lightning's Strategy, got {cls!r}")
    return cls()


def condense(message: str) -> str:
    """Another library's message (jsonargparse's, Lightning's) as one line: its lines joined. The values vitkit can
    check are checked before (``values.check_values``), in vitkit's words."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())


class OneLineLightningParser(LightningArgumentParser):
    """Lightning's parser (jsonargparse's), whose errors are a :class:`~vitkit.errors.UsageError` of one line, as
    argparse's are in the other subcommands (instead of the usage listing and a nested message); where jsonargparse
    asks for its own exception instead, it still gets one. A required option left out is named by its flags
    (``-o/--out``) before jsonargparse parses."""

    def parse_args(self, args=None, *rest, **kwargs):
        given = sys.argv[1:] if args is None else list(args)
        if not {"-h", "--help"} & set(given):
            missing = ["/".join(a.option_strings) for a in self._actions if a.required and a.option_strings
                       and not any(g == o or g.startswith(o + "=") for g in given for o in a.option_strings)]
            if missing and self.exit_on_error:
                self.error(f"the following arguments are required: {', '.join(missing)}")
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line = usage_error(parser.prog.replace(" [options]", ""), condense(message))
        if line.startswith("--model"):  # the module's options are listed by its own help, not the command's
            line = line[:-1] + "; `--model.help CLASS` a module's, e.g. vitkit.lit.Segmenter)"
        raise UsageError(line)


def _trainer_line(e: Exception, cfg: Namespace) -> str:
    """A trainer the machine cannot run, said once: what the config asked for, what is here, and the flags that run
    it here."""
    import torch

    asked = f"accelerator={cfg.get('accelerator')}, devices={cfg.get('devices')}, precision={cfg.get('precision')}"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    line = f"the trainer cannot start as configured ({asked}): {condense(str(e))}; this machine has {gpus} " \
           "CUDA GPU(s)"
    if not gpus:
        line += ("; to run on its CPU add --trainer.accelerator cpu --trainer.devices 1 --trainer.precision 32-true "
                 "(or bf16-mixed)")
    return line


# config fields a recipe may set on any preset without choosing its shapes
REGULARISATION = {"drop_path_rate", "drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate"}


def default_model(argv: list[str]) -> str:
    """The module class the parser starts from: the one ``argv`` chooses (``--model``, a config's ``class_path``),
    so that the arguments it leaves out take that class's defaults (a recipe part starts from the module's own
    recipe, not from the classifier's that a changed class path would carry over); else ``ImageClassifier``, by the
    name checkpoints keep."""
    chosen = model_class(argv)
    cls = class_at(chosen)
    return chosen if isinstance(cls, type) and issubclass(cls, L.LightningModule) else CLASSIFIER


def _model_args(argv: list[str]) -> list[str]:
    """``argv`` with a flat argument of before the module's parts refused, the values given checked against their
    types, and a part's field set to null as jsonargparse takes it."""
    refuse_flat(argv)
    check_values(argv)
    return nulls_as_mappings(argv)


class VitkitCLI(LightningCLI):
    """LightningCLI with the module and data chosen by class path, facts linked between them (image size,
    classes, vocabularies, normalisation), and every output under the run's root folder."""

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", OneLineLightningParser)
        if args is None:  # from the shell: LightningCLI reads sys.argv itself
            sys.argv[1:] = _model_args(with_recipes(take_verbose_flag(take_traceback_flag(sys.argv[1:]))))
        else:
            args = _model_args(with_recipes(take_verbose_flag(take_traceback_flag(args))))
        given = sys.argv[1:] if args is None else args
        self._model_args_given = given_model_args(given)
        self._model_default = default_model(given)
        # the subcommand whose parser alone is built; all four where parser_kwargs set one of them apart
        per_subcommand = set(kwargs.get("parser_kwargs") or {}) & set(LightningCLI.subcommands())
        self._asked = given[0] if given and not per_subcommand else None
        # no sanity validation before the first step, as in timm's training script: the folders are checked when
        # the data is set up, and vitkit's validation steps are its own (a recipe may set num_sanity_val_steps)
        super().__init__(L.LightningModule, None, subclass_mode_model=True, subclass_mode_data=True,
                         trainer_defaults={"callbacks": [TrainingCurves()], "num_sanity_val_steps": 0}, args=args,
                         run=run, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        """Lightning's four subcommands, or only the one the command line starts with (``fit ...``): each is a
        parser of its own over the trainer's, the module's and the data's arguments, and building the three that
        would not run is a good part of a command's start. ``--help`` lists all four."""
        every = LightningCLI.subcommands()
        return {self._asked: every[self._asked]} if self._asked in every else every

    def _parse_ckpt_path(self) -> None:
        """Lightning lays the checkpoint's hyperparameters over the whole parsed config, so a ``--model.X`` given
        beside ``--ckpt_path`` (``validate --model.model_overrides.token_merging=16``) was dropped without a word.
        Here the command line wins: its model arguments are put back, and ``model_overrides`` keeps the
        checkpoint's fields with the given ones on top."""
        sub = self.config.get("subcommand")
        before = self.config[sub].get("model") if sub else None
        before = before.clone() if before is not None else None
        self._parse_ckpt_hparams()
        if before is None or not self._model_args_given:
            return
        after = self.config[sub]["model"]
        for key in self._model_args_given:
            if key not in before.init_args:
                continue
            if key == "model_overrides":
                after.init_args[key] = {**(after.init_args.get(key) or {}), **(before.init_args[key] or {})}
            else:
                after.init_args[key] = before.init_args[key]

    def _parse_ckpt_hparams(self) -> None:
        """Lightning's: the checkpoint's hyper-parameters laid over the parsed config; a checkpoint of a module's flat
        arguments (written before its parts) is refused, naming the command that upgrades it."""
        sub = self.config.get("subcommand")
        ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        hparams = read_hparams(ckpt_path)
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        class_path = hparams.pop("_class_path", None)
        refuse_flat_checkpoint(ckpt_path, hparams, flat_of(class_path))
        model = {"class_path": class_path, "dict_kwargs": hparams} if class_path else hparams
        try:
            self.config = self.parser.parse_object({sub: {"model": model}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": self._model_default}})
        parser.link_arguments("data.init_args.img_size", "model.init_args.img_size")
        parser.link_arguments("model.init_args.model_name", "data.init_args.model_name")
        for source, target in registry.links().items():  # each task's; a module takes those of its own arguments
            parser.link_arguments("data", f"model.init_args.{target}", compute_fn=_attribute(source),
                                  apply_on="instantiate")

    # -- one folder per run ------------------------------------------------------------------------------

    def _section(self) -> Namespace:
        return self.config[self.subcommand] if self.subcommand else self.config

    def _recipe_preset_gives_way(self, cfg: Namespace) -> None:
        """A recipe's preset is a default, not the user's choice: with ``--model.checkpoint`` and no
        ``--model.model_name``, the model (and the data's normalisation) is the checkpoint's own preset, the one it
        records or the one its shapes fit. A preset the user named stays, and a file it does not fit is refused."""
        init = cfg.model.get("init_args")
        shaped = set(init.get("model_overrides") or {}) - REGULARISATION if init is not None else set()
        if init is None or not init.get("checkpoint") or "model_name" not in init or shaped or \
                "model_name" in self._model_args_given:
            return  # the user named the preset, or the recipe or the user shaped it (overrides of that preset)
        shipped = recipes.recipes_dir().resolve()
        configs = [Path(str(c)).resolve() for c in cfg.get("config") or []]
        if not configs or any(c.parent != shipped for c in configs):
            return  # no recipe, or a file of the user's own that may name the preset
        name, how = checkpoint_preset(init.checkpoint)
        if name is None:
            return  # no preset fits: loading it into the recipe's says what differs
        if name != init.model_name:
            rank_zero_info(f"model: {name} ({how}), the preset of {init.checkpoint}, in place of the recipe's default "
                           f"{init.model_name}; --model.model_name chooses another")
        init.model_name = name
        data = cfg.get("data")
        if data is not None and "model_name" in (data.get("init_args") or {}):
            data.init_args.model_name = name

    def _say_dropped_data_settings(self, cfg: Namespace) -> None:
        """A data module named over a config's other one (``--data vitkit.lit.ImageFolderDataModule``) takes the
        config's data settings it has fields for; the others are said, in one line, not dropped in silence."""
        section = None
        for c in cfg.get("config") or []:
            text = read_config(str(c))
            if isinstance(text, dict) and isinstance(text.get("data"), dict):
                section = text["data"]
        data = cfg.get("data")
        if section is None or data is None or section.get("class_path") in (None, data.get("class_path")):
            return
        dropped = [k for k in section.get("init_args") or {} if k not in (data.get("init_args") or {})]
        if dropped:
            rank_zero_info(f"data: {data.class_path} has no field for the config's {section['class_path']} "
                           f"setting(s) {', '.join(dropped)}; they do not apply")

    def before_instantiate_classes(self) -> None:
        cfg = self._section()
        self._say_dropped_data_settings(cfg)
        if cfg.trainer.default_root_dir is None:
            configs = cfg.get("config") or []
            name = Path(str(configs[-1])).stem if configs else cfg.model.init_args.get("model_name", "run")
            cfg.trainer.default_root_dir = os.path.join("runs", name)
        if cfg.trainer.get("enable_progress_bar") is False and cfg.trainer.get("callbacks"):
            # the configs name a progress bar; with the bar turned off Lightning would refuse to start
            cfg.trainer.callbacks = [cb for cb in cfg.trainer.callbacks
                                     if not str(getattr(cb, "class_path", "")).endswith("ProgressBar")]
        loggers = cfg.trainer.logger
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init = getattr(logger, "init_args", None)  # a logger given by class path (not True / False / None)
            if init is not None and init.get("save_dir") in (None, "."):  # unset, or WandbLogger's default
                init.save_dir = cfg.trainer.default_root_dir
            if init is not None and "name" in init and init.name is None:  # WandbLogger: the run's name
                init.name = Path(cfg.trainer.default_root_dir).name

    def instantiate_classes(self) -> None:
        """Build the data, the trainer and then the module (an error about the input, raised inside jsonargparse's
        Union, still names vitkit's cause: ``vitkit.errors.user_error``). A fit's batch fitted to its data
        (``training.steps.StepsPerEpoch``) is decided between the two, so that the module is built with its LR."""
        self._recipe_preset_gives_way(self._section())  # reads the checkpoint: a part of building, not parsing
        if self.subcommand != "fit":
            return super().instantiate_classes()
        first = self.config.clone()
        first[self.subcommand].model = None
        self.config_init = self.parser.instantiate_classes(first)  # the data module and the trainer's callbacks
        self.datamodule, self.model = self._get(self.config_init, "data"), None
        packs = bool(getattr(self.datamodule, "hparams", {}).get("packing"))  # its eval sizes are the model's: set
        if not packs:  # up once the model is, and a batch fitted to it as fit sets it up (the callback's own way)
            self._set_up_data()
        self.trainer = self.instantiate_trainer()
        if not packs:
            self._fit_batch_to_data()
        rest = self.config.clone()  # the module, linked to the data module built above
        rest[self.subcommand].data = self.datamodule
        rest[self.subcommand].trainer.callbacks = self.config_init[self.subcommand].trainer.callbacks
        self.config_init[self.subcommand].model = self._get(self.parser.instantiate_classes(rest), "model")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        if packs:  # packing (--data.packing) sized for this model, not only its preset's name
            self.datamodule.packed_model = getattr(self.model, "model", None)
            self._set_up_data()

    def _fit_batch_to_data(self) -> None:
        """The batch a small training split runs at, and the LR the module is built with (``StepsPerEpoch``)."""
        trainer, cfg = self.trainer, self._section()
        if not getattr(self.datamodule, "sets_up_locally", False):
            return  # a stream's split is the trainer's to make: the callback decides as fit sets it up
        world = max(1, trainer.world_size) * trainer.accumulate_grad_batches
        init = cfg.model.get("init_args") or Namespace()
        recipe = init.get("recipe") if isinstance(init.get("recipe"), Namespace) else None
        for cb in trainer.callbacks:
            fit = cb.decide(self.datamodule, world, recipe) if isinstance(cb, StepsPerEpoch) else None
            if fit is None:
                continue
            cfg.data.init_args.batch_size = fit.new  # the run's config.yaml says what ran
            if fit.lr is not None:
                recipe.lr = fit.lr
            rank_zero_info(fit.line())

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        cfg = self._section().trainer
        if not cfg.get("plugins"):
            kwargs.setdefault("plugins", [AtomicCheckpointIO()])
        if isinstance(cfg.strategy, str) and "." in cfg.strategy:  # `--trainer.strategy pkg.Class`: the class,
            kwargs["strategy"] = strategy_from_path(cfg.strategy)  # not a registered name that Lightning lowercases
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except MisconfigurationException as e:  # no such GPU here, too many devices, ...
            raise UsageError(_trainer_line(e, cfg)) from e
        for cb in trainer.checkpoint_callbacks:  # known before fit, so that --ckpt_path last finds last.ckpt
            if isinstance(cb, _LightningModelCheckpoint) and cb.dirpath is None:
                cb.dirpath = checkpoints_dir(trainer)
        trainer.callbacks = [ModelSummary(cb._max_depth) if type(cb) in (LightningSummary, RichModelSummary) else cb
                             for cb in trainer.callbacks]  # no FLOPs column of zeros
        if trainer.loggers and not any(isinstance(cb, LearningRateMonitor) for cb in trainer.callbacks):
            trainer.callbacks.append(LearningRateMonitor(logging_interval="step"))  # it needs a logger
        return trainer

    def _set_up_data(self) -> None:
        """The data of a fit set up before the trainer is built: a folder's errors (a missing mask, a class the masks
        should not hold) end the command before Lightning prints anything or makes the run's folder."""
        if getattr(self.datamodule, "sets_up_locally", False):
            self.datamodule.setup("fit")

    def before_fit(self) -> None:
        dm = self.datamodule
        if getattr(dm, "sets_up_locally", False):  # a split too small for one batch: refused before anything is
            # written (Lightning makes the logger's folder before it sets the data up)
            try:
                dm.check_train_size(self.trainer)
            except ValueError as e:
                raise UsageError(str(e)) from e
        for cb in self.trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint):  # refuse to replace another run's last.ckpt, before any write
                settle_interrupted_saves(cb.dirpath)  # a sharded save killed between its two renames
                try:
                    cb.check_fresh(self.trainer, self.config_init[self.subcommand].get("ckpt_path"))
                except FileExistsError as e:
                    raise UsageError(str(e)) from e


    def before_test(self) -> None:
        self._refuse_a_test_split_it_trained_on()

    def _refuse_a_test_split_it_trained_on(self) -> None:
        """A data module that carves its test split out of the data (``SPLIT_SETTINGS``: the digits'
        ``test_fraction``) holds out what the checkpoint's run never saw only with the settings that run split by."""
        dm, path = self.datamodule, self.config_init["test"].get("ckpt_path")
        settings = getattr(dm, "SPLIT_SETTINGS", ())
        if not settings or path is None:
            return
        if path in ("last", "best"):
            callback = self.trainer.checkpoint_callback
            path = getattr(callback, "best_model_path", "") if path == "best" else \
                os.path.join(getattr(callback, "dirpath", None) or "", "last.ckpt")
        if not path or not os.path.isfile(path):
            return  # Lightning names a missing file
        trained = read_hparams(path, "datamodule_hyper_parameters")
        if not trained or trained.get("_class_path", "").rpartition(".")[2] not in ("", type(dm).__name__):
            return
        differ = [k for k in settings if k in trained and trained[k] != dm.hparams.get(k)]
        if differ:
            was = ", ".join(f"--data.{k} {trained[k]}" for k in differ)
            now = ", ".join(f"{dm.hparams.get(k)}" for k in differ)
            raise UsageError(f"{path} was trained with {was}; a test split carved now with {now} holds data that "
                             f"run trained on: test it with {was}, or hold the test split out when training (fit "
                             "and test with the same --data settings)")


def cli_main(args: list[str] | None = None, run: bool = True, prog: str | None = None) -> LightningCLI:
    """``vitkit train fit -c vit_tiny_digits``; ``args`` replaces sys.argv[1:], ``prog`` names the program in
    ``--help``. Bad input raises a :class:`~vitkit.errors.UsageError` (or one of its kinds), which ``vitkit.cli.main``
    turns into the command's one ``error:`` line."""
    with quiet(sys.argv if args is None else args):
        return VitkitCLI(args=args, run=run, **({"parser_kwargs": {"prog": prog}} if prog else {}))


def main(argv: list[str], prog: str = "vitkit train") -> int:
    """``vitkit train ARGS``. ``sys.argv`` stays as typed: Lightning starts the other processes of a multi-device run
    by running that same command line again (LightningCLI then warns that it was given both; that is the point)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        cli_main(argv, prog=prog)
    return 0
