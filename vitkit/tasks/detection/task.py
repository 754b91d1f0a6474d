"""The detection task as the commands see it (``vitkit.tasks.protocol``)."""

from vitkit.tasks.protocol import Task

TASK = Task(
    name="detection",
    modules=("vitkit.lit.Detector", "vitkit.tasks.detection.detector.Detector"),
    links={"num_classes": "num_classes", "classes": "class_names", "category_ids": "category_ids"},
    predictor="vitkit.tasks.detection.inference:predictor",
    evaluate="vitkit.tasks.detection.evaluate:evaluate",
    export_model="vitkit.tasks.detection.inference:export_model",
    data_module="vitkit.lit.DetectionDataModule",
    int8_gate="vitkit.tasks.detection.quantize:MeanAP",
    claims="vitkit.tasks.detection.inference:claims",
)
