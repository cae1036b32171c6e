"""The ONNX versions every graph and function body of an export is written for."""

OPSET = 24
IR_VERSION = 11  # what onnxruntime 1.31 reads for opset 24 (it refuses IR 14)
