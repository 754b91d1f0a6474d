"""The LightningCLI behind ``train.py`` (fit / validate / test / predict), callable from tests.

The model's preset picks the module: image classifiers train as :class:`ImageClassifier`, the
encoder-decoder presets (``transformer_*``, ``ocr_*``) as :class:`Seq2SeqModule`.
"""

from __future__ import annotations

import sys

import yaml
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from vitkit.models import family

from .callbacks import TrainingCurves
from .classifier import ImageClassifier
from .data import DigitsDataModule  # noqa: F401  (the default data class path)
from .seq2seq import Seq2SeqModule


class VitkitCLI(LightningCLI):
    """Links what the data decides (classes, image size) into the model, and the preset's normalisation
    into the data, so a config names each fact once."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.init_args.img_size", "model.img_size")
        parser.link_arguments("model.model_name", "data.init_args.model_name")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.classes", "model.class_names", apply_on="instantiate")


class Seq2SeqCLI(LightningCLI):
    """Links the data's vocabularies and tokenizers into the encoder-decoder."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for key in ("src_vocab_size", "tgt_vocab_size", "tokenizers"):
            parser.link_arguments(f"data.{key}", f"model.{key}", apply_on="instantiate")


def _model_name(argv: list[str]) -> str | None:
    """The preset named by the last --config file or --model.model_name flag (as LightningCLI reads them)."""
    name = None
    for i, a in enumerate(argv[:-1]):
        if a in ("--config", "-c"):
            try:
                cfg = yaml.safe_load(open(argv[i + 1])) or {}
            except OSError:
                continue  # LightningCLI reports the missing file itself
            name = (cfg.get("model") or {}).get("model_name", name)
        elif a == "--model.model_name":
            name = argv[i + 1]
    for a in argv:
        if a.startswith("--model.model_name="):
            name = a.split("=", 1)[1]
    return name


def cli_main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """``python train.py fit --config configs/vit_tiny_digits.yaml``; ``args`` replaces sys.argv[1:]."""
    name = _model_name(sys.argv[1:] if args is None else args)
    try:
        seq2seq = name is not None and family(name) == "seq2seq"
    except ValueError:
        seq2seq = False  # an unknown name: the classifier's CLI reports it
    cli_cls, model_cls = (Seq2SeqCLI, Seq2SeqModule) if seq2seq else (VitkitCLI, ImageClassifier)
    return cli_cls(
        model_cls,
        datamodule_class=None,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [LearningRateMonitor(logging_interval="step"), TrainingCurves()]},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
