"""The tasks vitkit trains, each a package with its Lightning module(s) and its report, on the shared training
base (``vitkit.training``) and the data modules beside their readers (``vitkit.data.modules``):

* ``classification``: one label or several per image, small labelled sets (the probe first), distillation,
  linear probing (``ImageClassifier``);
* ``pretraining``: MAE and SimMIM (``MaskedImageModeling``), DINO (``DINOPretraining``);
* ``segmentation``: a class per pixel (``Segmenter``);
* ``text``: the encoder-decoder, on text or on images (``Seq2SeqModule``).

No task imports another; adding a task is adding a package here. Recipes and checkpoints name these classes as
``vitkit.lit.<Name>``, which keeps working."""
