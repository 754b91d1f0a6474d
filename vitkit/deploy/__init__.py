"""Models as files to run elsewhere: ONNX and torch.export with their preprocessing (``export``), a ViT's packed
forward in dense ops (``export_packed``), int8 ONNX and int8 .pt2 with an accuracy gate (``quantize``,
``quantize_program``), and an export run in onnxruntime without torch (``onnx_model``)."""
