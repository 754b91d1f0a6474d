"""Tools around the models: throughput benchmarks (``bench``), ONNX and torch.export (``export``), attention and
position-embedding pictures and training curves (``plots``), and GMACs on the meta device (``flops``)."""
