"""Pre-training as the commands see it (``vitkit.tasks.protocol``): its checkpoints hold a backbone, which
``vitkit evaluate --knn`` / ``--linear-probe`` scores and the fine-tuning recipes read (``--model.checkpoint``)."""

from vitkit.tasks.protocol import Task

TASK = Task(
    name="pretraining",
    modules=("vitkit.lit.MaskedImageModeling", "vitkit.lit.DINOPretraining",
             "vitkit.tasks.pretraining.mim.MaskedImageModeling", "vitkit.tasks.pretraining.dino.DINOPretraining"),
)
