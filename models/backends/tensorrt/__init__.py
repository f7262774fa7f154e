"""The native TensorRT backend (`trt`): `.plan` engines as sessions
(session.py, backend.py), the LLM decode loop (decode.py), the flow caches
(flow_cache.py) and the fixed-shape stages' CUDA-graph runtimes (graph.py,
static_flow.py, static_vocoder.py) on the device; the CUDA layer they share
is models/backends/cuda.py. Imports no onnxruntime (import-linter)."""
