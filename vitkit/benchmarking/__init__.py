"""What ``vitkit bench`` and ``benchmarks/`` measure with: throughput beside timm and torchvision (``bench``), the
interleaved timing (``timing``), GMACs on the meta device (``flops``) and token merging's trade-off on a checkpoint
(``merging``)."""
