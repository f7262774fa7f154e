"""Inference backends: the same `Session` interface (base.py) over ONNX Runtime
(CPU, CUDA or TensorRT execution providers) and native TensorRT engines,
picked by name in factory.py. The synthesis loop only ever talks to the
interface."""
