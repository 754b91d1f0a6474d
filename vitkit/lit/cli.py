"""The LightningCLI behind ``train.py`` (fit / validate / test / predict), callable from tests."""

from __future__ import annotations

from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from .classifier import ImageClassifier
from .data import DigitsDataModule  # noqa: F401  (the default data class path)


class VitkitCLI(LightningCLI):
    """Links what the data decides (classes, image size) into the model, and the preset's normalisation
    into the data, so a config names each fact once."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.init_args.img_size", "model.img_size")
        parser.link_arguments("model.model_name", "data.init_args.model_name")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.classes", "model.class_names", apply_on="instantiate")


def cli_main(args: list[str] | None = None, run: bool = True) -> VitkitCLI:
    """``python train.py fit --config configs/vit_tiny_digits.yaml``; ``args`` replaces sys.argv[1:]."""
    return VitkitCLI(
        ImageClassifier,
        datamodule_class=None,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [LearningRateMonitor(logging_interval="step")]},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
