"""The upstream CosyVoice 2 modules (llm, flow, hift), built from a model
directory's `cosyvoice2.yaml` with hyperpyyaml and loaded strictly, the way
upstream's `CosyVoice2` class does it.

Only the model part of the yaml is loaded (its scalar parameters and the
`llm`, `flow`, `hift` blocks): the gan and data sections import training-only
packages (torchaudio, pyworld, matcha's GAN) that this environment cannot
install. The CosyVoice modules still `import torchaudio` at module level
without using it for inference, so a stand-in module takes its place when the
real one is missing.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import re
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_models.errors import CheckpointError, MissingExtraError

log = logging.getLogger(__name__)

YAML_NAME = "cosyvoice2.yaml"
QWEN_DIR = "CosyVoice-BlankEN"
WEIGHT_FILES = ("llm.pt", "flow.pt", "hift.pt")
CARRIED_ONNX = ("campplus.onnx", "speech_tokenizer_v2.onnx")
REQUIRED_FILES = (YAML_NAME, *WEIGHT_FILES, *CARRIED_ONNX, f"{QWEN_DIR}/config.json")
# class names the yaml must instantiate for a CosyVoice 2 checkpoint
EXPECTED_CLASSES = {
    "llm": "cosyvoice.llm.llm.Qwen2LM",
    "flow": "cosyvoice.flow.flow.CausalMaskedDiffWithXvec",
    "hift": "cosyvoice.hifigan.generator.HiFTGenerator",
}
MODEL_BLOCKS = ("llm", "flow", "hift")

_TOP_KEY = re.compile(r"^([A-Za-z_][\w]*)\s*:(.*)$")


def require(module: str, package: str, purpose: str) -> Any:
    """Import a build-side dependency, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(package, "build", purpose) from exc


class StandInModule(types.ModuleType):
    """Takes the place of a package that the CosyVoice modules import but
    never use on the inference path; any use of it fails loudly."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"'{self.__name__}.{name}' was used, but '{self.__name__}' is not installed: cosyedge puts a "
            f"stand-in module there only so that the upstream CosyVoice modules import; the inference "
            f"path must not call it"
        )


def _install_stand_in(name: str, **attributes: Any) -> None:
    if name in sys.modules:
        return
    parent = name.rpartition(".")[0]
    if not parent and importlib.util.find_spec(name) is not None:
        return  # the real package is installed: use it
    module = StandInModule(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []
    for key, value in attributes.items():
        setattr(module, key, value)
    sys.modules[name] = module
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], name.rpartition(".")[2], module)


class _UnavailableTokenizer:
    """Placeholder for whisper.tokenizer.Tokenizer (CosyVoice 1's tokenizer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("openai-whisper is not installed; CosyVoice 2 uses the Qwen tokenizer")


def install_stand_ins() -> None:
    """Stand-ins for torchaudio (and for the tokenizer module: whisper,
    tiktoken). transformers must be imported first: it probes for torchaudio
    at import time and would take the stand-in for the real package."""
    require("transformers", "transformers", "loading the reference CosyVoice modules")
    _install_stand_in("torchaudio")
    _install_stand_in("whisper")
    _install_stand_in("whisper.tokenizer", Tokenizer=_UnavailableTokenizer)
    _install_stand_in("tiktoken")
    # matcha's training utilities import these download helpers at module level
    # (pulled in through cosyvoice.flow.flow_matching); inference never calls them.
    _install_stand_in("gdown")
    _install_stand_in("wget")


def check_checkpoint_dir(model_dir: Path) -> str:
    """Raise CheckpointError unless `model_dir` has the CosyVoice 2 layout;
    return the yaml text."""
    model_dir = Path(model_dir)
    expected = ", ".join(REQUIRED_FILES)
    if not model_dir.is_dir():
        raise CheckpointError(
            f"{model_dir} is not a directory; expected a CosyVoice 2 model directory ({expected})"
        )
    missing = [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]
    if missing:
        raise CheckpointError(
            f"{model_dir} is not a CosyVoice 2 checkpoint: missing {', '.join(missing)}; expected {expected} "
            f"(the layout of CosyVoice2-0.5B)"
        )
    text = (model_dir / YAML_NAME).read_text(encoding="utf-8")
    blocks = split_top_level(text)
    for key, cls in EXPECTED_CLASSES.items():
        first_line = blocks[key].splitlines()[0] if key in blocks else ""
        if f"!new:{cls}" not in first_line:
            found = re.search(r"!new:([\w.]+)", first_line)
            raise CheckpointError(
                f"{model_dir / YAML_NAME} does not describe a CosyVoice 2 model: its '{key}' is "
                f"{found.group(1) if found else 'missing'}, expected !new:{cls}"
            )
    return text


def split_top_level(text: str) -> dict[str, str]:
    """The yaml's top-level entries as text blocks (key line + its indented
    continuation lines), in file order."""
    blocks: dict[str, str] = {}
    key: str | None = None
    for line in text.splitlines():
        match = _TOP_KEY.match(line)
        if match:
            key = match.group(1)
            blocks[key] = line
        elif key is not None:  # indented lines, comments, a closing ']'
            blocks[key] += "\n" + line
    return blocks


def model_part(text: str) -> str:
    """The yaml reduced to its scalar parameters and the llm/flow/hift blocks."""
    kept = []
    for key, block in split_top_level(text).items():
        first = block.splitlines()[0]
        value = _TOP_KEY.match(first).group(2).strip()  # type: ignore[union-attr]
        body = [ln for ln in block.splitlines()[1:] if ln.strip() and not ln.lstrip().startswith("#")]
        single_line = not body
        is_scalar = (
            single_line
            and not re.search(r"!(new|name|apply|include|copy|tuple|module):", value)
            and not value.startswith("[")
            and not key.startswith("__")
        )
        if key in MODEL_BLOCKS or is_scalar:
            kept.append(block)
    return "\n".join(kept) + "\n"


@dataclass
class ReferenceModels:
    """The three upstream modules plus the yaml's scalar parameters."""

    model_dir: Path
    llm: Any  # cosyvoice.llm.llm.Qwen2LM
    flow: Any  # cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    hift: Any  # cosyvoice.hifigan.generator.HiFTGenerator
    config: dict[str, Any]  # everything the model part of the yaml defines (incl. the modules)


def build_modules(model_dir: Path) -> dict[str, Any]:
    """Instantiate the model part of the yaml (random weights, or the Qwen2
    weights of CosyVoice-BlankEN) exactly as upstream does."""
    model_dir = Path(model_dir)
    return instantiate(model_dir, check_checkpoint_dir(model_dir))


def instantiate(model_dir: Path, text: str) -> dict[str, Any]:
    """load_hyperpyyaml on the model part of `text`, with qwen_pretrain_path
    pointing into `model_dir` (what upstream passes as an override)."""
    require("torch", "torch", "loading the reference CosyVoice modules")
    install_stand_ins()
    hyperpyyaml = require("hyperpyyaml", "HyperPyYAML", "loading cosyvoice2.yaml")
    try:
        importlib.import_module("cosyvoice.llm.llm")
    except ImportError as exc:
        raise MissingExtraError(
            getattr(exc, "name", None) or "token2wav-cosyvoice", "build", "the reference CosyVoice modules"
        ) from exc
    transformers_logging = require("transformers", "transformers", "loading the reference modules").logging
    verbosity = transformers_logging.get_verbosity()
    try:
        # quiet: diffusers' LoRA deprecation notes, Qwen2's sliding-window note (off in CosyVoice 2)
        transformers_logging.set_verbosity_error()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            configs = hyperpyyaml.load_hyperpyyaml(
                model_part(text), overrides={"qwen_pretrain_path": str(model_dir / QWEN_DIR)}
            )
    except ImportError as exc:  # a module the yaml names needs a package that is not installed
        raise MissingExtraError(
            getattr(exc, "name", None) or str(exc),
            "build",
            f"building the modules of {model_dir / YAML_NAME}",
        ) from exc
    except Exception as exc:  # malformed yaml, wrong arguments, a broken Qwen2 directory
        raise CheckpointError(
            f"{model_dir / YAML_NAME}: building its llm/flow/hift failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        transformers_logging.set_verbosity(verbosity)
    return dict(configs)


def load_reference(model_dir: Path) -> ReferenceModels:
    """Build the modules and load llm.pt / flow.pt / hift.pt with strict=True,
    in eval mode on the CPU."""
    torch = require("torch", "torch", "loading the reference CosyVoice modules")
    model_dir = Path(model_dir)
    configs = build_modules(model_dir)
    for key in MODEL_BLOCKS:
        cls = EXPECTED_CLASSES[key].rpartition(".")[2]
        if type(configs[key]).__name__ != cls:
            raise CheckpointError(
                f"{model_dir / YAML_NAME}: '{key}' built a {type(configs[key]).__name__}, expected {cls}"
            )
    for key, file in zip(MODEL_BLOCKS, WEIGHT_FILES, strict=True):
        try:
            state = torch.load(model_dir / file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: say which one
            raise CheckpointError(f"{model_dir / file} is not a PyTorch state dict: {exc}") from exc
        if key == "hift":  # as upstream: a HiFiGan checkpoint keeps the generator under 'generator.'
            state = {k.replace("generator.", ""): v for k, v in state.items()}
        # fp32 as upstream runs it: transformers 5 builds the Qwen2 inside in the
        # checkpoint's bf16 (4.x in fp32), which would round llm.pt and mix dtypes
        configs[key].float()
        try:
            configs[key].load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(
                f"{model_dir / file} does not match the {key} that {YAML_NAME} describes: {exc}"
            ) from exc
        configs[key].to("cpu").eval()
    return ReferenceModels(
        model_dir=model_dir, llm=configs["llm"], flow=configs["flow"], hift=configs["hift"], config=configs
    )


def load_qwen_tokenizer(model_dir: Path) -> Any:
    """Upstream's QwenTokenizer (AutoTokenizer + CosyVoice's special tokens)
    on the checkpoint's CosyVoice-BlankEN."""
    model_dir = Path(model_dir)
    if not (model_dir / QWEN_DIR).is_dir():
        raise CheckpointError(
            f"{model_dir} has no {QWEN_DIR}/ (the Qwen2 tokenizer of a CosyVoice 2 checkpoint)"
        )
    require("torch", "torch", "the reference tokenizer")
    install_stand_ins()
    module = importlib.import_module("cosyvoice.tokenizer.tokenizer")
    return module.QwenTokenizer(token_path=str(model_dir / QWEN_DIR), skip_special_tokens=True)
