"""A frozen backbone (``freeze_backbone``) is an inference model in every training step of every epoch: its drop
path and dropout are off, so the head learns from the features the backbone gives at evaluation."""

import lightning as L
import torch
from torch.testing import assert_close

from vitkit.lit import DigitsDataModule, Frozen, ImageClassifier, Recipe

TINY = {"depth": 2, "embed_dim": 32, "num_heads": 2, "patch_size": 8, "drop_path_rate": 0.5, "pos_drop_rate": 0.5}


class RecordFeatures(L.Callback):
    """In each training step: the backbone's output (the final norm's) and, on the same batch, what the model in
    eval mode gives; and which modules were in train mode."""

    def __init__(self) -> None:
        self.pairs, self.train_mode = [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._seen = []
        self._hook = module.model.norm.register_forward_hook(lambda m, i, o: self._seen.append(o.detach().clone()))
        self.train_mode.append({n for n, m in module.model.named_modules() if m.training})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._hook.remove()
        modes = {n: m.training for n, m in module.named_modules()}
        module.eval()
        with torch.no_grad():
            reference = module.model.forward_features(batch[0])
        for n, m in module.named_modules():
            m.training = modes[n]
        self.pairs.append((self._seen[0], reference))


def test_a_frozen_backbone_gives_its_eval_features_in_every_training_step(tmp_path):
    module = ImageClassifier("vit_tiny_patch16_224", model_overrides=TINY, num_classes=10, img_size=32,
                             adaptation=Frozen(), recipe=Recipe(lr=5e-4, weight_decay=0.05))
    record = RecordFeatures()
    trainer = L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu", devices=1,
                        callbacks=[record], default_root_dir=tmp_path)
    trainer.fit(module, DigitsDataModule(img_size=32, batch_size=16))
    assert len(record.pairs) == 4  # two steps in each of two epochs, a validation between them
    for seen, reference in record.pairs:
        assert_close(seen, reference)
    # only the head (and the model object that holds it, whose forward reads no mode but the head's) trains
    assert all(mode - {""} and all(n.startswith("head") for n in mode - {""}) for mode in record.train_mode), \
        record.train_mode
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("head") for n in trainable)


def test_without_freezing_the_same_features_are_noised_by_drop_path(tmp_path):
    """The check above can fail: a backbone in train mode, with the same drop path, gives other features."""
    module = ImageClassifier("vit_tiny_patch16_224", model_overrides=TINY, num_classes=10, img_size=32,
                             recipe=Recipe(lr=5e-4, weight_decay=0.05))
    record = RecordFeatures()
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, accelerator="cpu", devices=1, callbacks=[record],
                        default_root_dir=tmp_path)
    trainer.fit(module, DigitsDataModule(img_size=32, batch_size=16))
    seen, reference = record.pairs[0]
    assert (seen - reference).abs().max() > 1e-2
