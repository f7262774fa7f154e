"""`cosyedge model pull`: download a CosyVoice 2 checkpoint from its model
hub (only the files the export reads, checked against the hub's sizes and
hashes) and build the bundle this machine can use with the build stages
(export, quantize, engines), each stage resumable."""
