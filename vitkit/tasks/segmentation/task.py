"""The segmentation task as the commands see it (``vitkit.tasks.protocol``)."""

from vitkit.tasks.protocol import Task

TASK = Task(
    name="segmentation",
    modules=("vitkit.lit.Segmenter", "vitkit.tasks.segmentation.segmenter.Segmenter"),
    links={"num_classes": "num_classes", "classes": "class_names", "ignore_index": "ignore_index"},
    predictor="vitkit.tasks.segmentation.inference:predictor",
    evaluate="vitkit.tasks.segmentation.evaluate:evaluate",
    export_model="vitkit.tasks.segmentation.inference:export_model",
    data_module="vitkit.lit.SegmentationDataModule",
)
