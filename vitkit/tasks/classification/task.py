"""The classification task as the commands see it (``vitkit.tasks.protocol``)."""

from vitkit.tasks.protocol import Task

TASK = Task(
    name="classification",
    modules=("vitkit.lit.ImageClassifier", "vitkit.tasks.classification.classifier.ImageClassifier"),
    links={"num_classes": "num_classes", "classes": "class_names"},
    predictor="vitkit.tasks.classification.inference:predictor",
    evaluate="vitkit.tasks.classification.evaluate:evaluate",
    export_model="vitkit.tasks.classification.inference:export_model",
    data_module="vitkit.lit.ImageFolderDataModule",
    int8_gate="vitkit.deploy.quantize:TopOne",
    other_files=True,  # a timm tag, torchvision weights, a state dict or a saved model folder: a classifier
)
