"""tokenizer.json: the checkpoint's Qwen2 tokenizer (CosyVoice-BlankEN)
with CosyVoice's added special tokens, exactly as upstream's QwenTokenizer
builds it, saved in the `tokenizers` format the runtime loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cosyedge_build.reference.modules as reference
from cosyedge_models.errors import CheckpointError

FILE = "tokenizer.json"


def export_tokenizer(model_dir: Path, out: Path) -> tuple[Path, dict[str, Any]]:
    qwen = reference.load_qwen_tokenizer(model_dir)
    hf = qwen.tokenizer
    if not getattr(hf, "is_fast", False):
        raise CheckpointError(
            f"{model_dir / reference.QWEN_DIR}: transformers built a slow tokenizer; "
            f"expected a Qwen2 BPE it can convert to the `tokenizers` format"
        )
    path = out / FILE
    hf.backend_tokenizer.save(str(path))
    special = {token: int(hf.convert_tokens_to_ids(token)) for token in hf.all_special_tokens}
    info = {"special_tokens": dict(sorted(special.items(), key=lambda kv: kv[1])), "vocab_size": len(hf)}
    return path, info


def decode(tokenizer_path: Path, ids: list[int]) -> str:
    tokenizers = reference.require("tokenizers", "tokenizers", "reading tokenizer.json")
    return str(tokenizers.Tokenizer.from_file(str(tokenizer_path)).decode(ids, skip_special_tokens=True))
