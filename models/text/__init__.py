"""The text side of the CosyVoice 2 runtime: tokenizer, normalization,
sentence splitting and the frontend that ties them together. numpy and
`tokenizers` only; no torch, pynini, ttsfrd or wetext."""
