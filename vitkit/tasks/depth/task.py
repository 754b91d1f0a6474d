"""The depth task as the commands see it (``vitkit.tasks.protocol``)."""

from vitkit.tasks.protocol import Task

TASK = Task(
    name="depth",
    modules=("vitkit.lit.DepthEstimator", "vitkit.tasks.depth.estimator.DepthEstimator"),
    links={"max_depth": "max_depth"},
    predictor="vitkit.tasks.depth.inference:predictor",
    evaluate="vitkit.tasks.depth.evaluate:evaluate",
    export_model="vitkit.tasks.depth.inference:export_model",
    data_module="vitkit.lit.DepthDataModule",
    int8_gate="vitkit.tasks.depth.quantize:AbsRel",
    claims="vitkit.tasks.depth.inference:claims",
)
