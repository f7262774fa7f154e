#!/usr/bin/env bash
# The official PyTorch pipeline alone on a GPU machine without network (the
# reference half of edge_build/tools/device_bench.sh, for a short device lease):
# builds the full-size checkpoint and its bundle (voices, tokenizer), then
# times upstream's CosyVoice2Model.tts on the GPU. Usage: device_reference.sh OUTDIR
set -euo pipefail
out=${1:?usage: device_reference.sh OUTDIR}
source "$(dirname "$0")/device_setup.sh"
python3 - "$out/reference_h200.json" <<'PY' 2>&1 | grep -v -i warn
import json, sys
from cosyedge_build.reference.pipeline import run_reference
from cosyedge_models.tools.bench import DEFAULT_TEXT
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.text.tokenizer import TextTokenizer
bundle = load_bundle("/tmp/full/bundle")
ref = run_reference(bundle, TextTokenizer.from_file(bundle.file("tokenizer")), DEFAULT_TEXT, repeats=2)
print(json.dumps(ref))
open(sys.argv[1], "w").write(json.dumps(ref, indent=2) + "\n")
PY
