"""Low-precision bundles: INT8 Q/DQ (calibrated, with a sensitivity pass) and
fp16 stage graphs, checked against fp32 before they are written."""
