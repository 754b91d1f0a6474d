"""Object detection: the set loss of DETR-style detectors (Hungarian matching of predictions to objects, class and
box terms), on the detectors of ``vitkit.models.detection``."""
