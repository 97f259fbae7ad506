"""Vision encoder stage: preprocessing, ONNX export and inference runtimes."""
