"""`cosyedge build tiny`: the official layout, strict loading through the
upstream modules, the carried ONNX models' I/O, determinism, the full-size
preset (slow), and clear errors for directories that are not CosyVoice 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import cosyedge_build.reference.modules as reference
import numpy as np
import onnxruntime as ort
import pytest
import torch
from cosyedge_build.checkpoint.tiny import build_tiny_checkpoint
from cosyedge_build.checkpoint.tiny_sizes import PRESETS
from cosyedge_build.reference.modules import StandInModule, load_reference, require
from cosyedge_daemon.cli.main import main
from cosyedge_models.errors import CheckpointError, CosyEdgeError, MissingExtraError

from tests.edge_build.conftest import Checkpoint
from tests.support.components import not_here

LAYOUT = [
    "cosyvoice2.yaml",
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "spk2info.pt",
    "CosyVoice-BlankEN/config.json",
    "CosyVoice-BlankEN/model.safetensors",
    "CosyVoice-BlankEN/generation_config.json",
    "CosyVoice-BlankEN/vocab.json",
    "CosyVoice-BlankEN/merges.txt",
    "CosyVoice-BlankEN/tokenizer_config.json",
    "CosyVoice-BlankEN/tokenizer.json",
]
# the sections of upstream's examples/libritts/cosyvoice2/conf/cosyvoice2.yaml
UPSTREAM_SECTIONS = [
    "__set_seed1",
    "__set_seed2",
    "__set_seed3",
    "__set_seed4",
    "sample_rate",
    "llm_input_size",
    "llm_output_size",
    "spk_embed_dim",
    "qwen_pretrain_path",
    "token_frame_rate",
    "token_mel_ratio",
    "chunk_size",
    "num_decoding_left_chunks",
    "llm",
    "flow",
    "hift",
    "mel_spec_transform1",
    "hifigan",
    "parquet_opener",
    "get_tokenizer",
    "allowed_special",
    "tokenize",
    "filter",
    "resample",
    "truncate",
    "feat_extractor",
    "compute_fbank",
    "compute_whisper_fbank",
    "compute_f0",
    "parse_embedding",
    "shuffle",
    "sort",
    "batch",
    "padding",
    "data_pipeline",
    "data_pipeline_gan",
    "train_conf",
    "train_conf_gan",
]


def test_official_layout_and_yaml_sections(checkpoint: Checkpoint) -> None:
    for rel in LAYOUT:
        assert (checkpoint.model_dir / rel).is_file(), rel
    yaml_text = (checkpoint.model_dir / "cosyvoice2.yaml").read_text()
    assert list(reference.split_top_level(yaml_text)) == UPSTREAM_SECTIONS
    config = json.loads((checkpoint.model_dir / "CosyVoice-BlankEN/config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    tok_config = json.loads((checkpoint.model_dir / "CosyVoice-BlankEN/tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "Qwen2Tokenizer"


def test_upstream_modules_load_strictly(checkpoint: Checkpoint) -> None:
    refs = checkpoint.refs
    assert type(refs.llm).__name__ == "Qwen2LM"
    assert type(refs.flow).__name__ == "CausalMaskedDiffWithXvec"
    assert type(refs.hift).__name__ == "HiFTGenerator"
    # what load_state_dict(strict=True) put there is what the files hold
    for module, file in ((refs.llm, "llm.pt"), (refs.flow, "flow.pt"), (refs.hift, "hift.pt")):
        saved = torch.load(checkpoint.model_dir / file, weights_only=True)
        state = module.state_dict()
        assert set(saved) == set(state), file
        assert all(torch.equal(saved[k], state[k]) for k in saved), file
    # the upstream flow's hard-coded 512 channels and 80 mel bins are kept
    assert refs.flow.encoder.pre_lookahead_layer.conv1.in_channels == 512
    assert refs.flow.output_size == 80
    sizes = PRESETS[checkpoint.name]
    assert refs.llm.llm.model.config.hidden_size == sizes.hidden_size


def test_torchaudio_stand_in(checkpoint: Checkpoint) -> None:
    module = sys.modules["torchaudio"]
    if not isinstance(module, StandInModule):
        not_here("the real torchaudio is installed here: this checks the stand-in")
    assert module.__spec__ is not None and module.__spec__.name == "torchaudio"
    with pytest.raises(AttributeError, match="stand-in"):
        module.load  # noqa: B018


def test_carried_onnx_models_have_the_real_io(checkpoint: Checkpoint) -> None:
    campplus = ort.InferenceSession(str(checkpoint.model_dir / "campplus.onnx"))
    (emb,) = campplus.run(
        None, {campplus.get_inputs()[0].name: np.random.randn(2, 93, 80).astype(np.float32)}
    )
    assert emb.shape == (2, 192) and np.isfinite(emb).all()
    tokenizer = ort.InferenceSession(str(checkpoint.model_dir / "speech_tokenizer_v2.onnx"))
    names = [i.name for i in tokenizer.get_inputs()]
    feats = np.random.randn(1, 128, 200).astype(np.float32)
    (tokens,) = tokenizer.run(None, {names[0]: feats, names[1]: np.array([200], np.int32)})
    assert tokens.shape == (1, 50) and tokens.min() >= 0 and tokens.max() < 6561
    assert len(np.unique(tokens)) > 5
    # frames past the length do not change the tokens before them
    feats[:, :, 100:] = 7.0
    (cut,) = tokenizer.run(None, {names[0]: feats, names[1]: np.array([100], np.int32)})
    (same,) = tokenizer.run(None, {names[0]: feats[:, :, :100], names[1]: np.array([100], np.int32)})
    assert np.array_equal(cut[:, :24], same[:, :24])
    spk2info = torch.load(checkpoint.model_dir / "spk2info.pt", weights_only=True)
    assert spk2info["default"]["embedding"].shape == (1, 192)


def test_cli_build_is_deterministic(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "again"
    assert main(["build", "tiny", "--out", str(out), "--seed", "0"]) == 0
    assert "wrote a tiny CosyVoice 2 checkpoint" in capsys.readouterr().out
    for file in ("llm.pt", "flow.pt", "hift.pt"):
        a = torch.load(out / file, weights_only=True)
        b = torch.load(tiny_model_dir / file, weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), file
    assert (out / "campplus.onnx").read_bytes() == (tiny_model_dir / "campplus.onnx").read_bytes()
    other = build_tiny_checkpoint(tmp_path / "seed1", seed=1)
    a = torch.load(other / "flow.pt", weights_only=True)
    b = torch.load(tiny_model_dir / "flow.pt", weights_only=True)
    assert not torch.equal(a["spk_embed_affine_layer.weight"], b["spk_embed_affine_layer.weight"])


def test_build_refuses_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(CosyEdgeError, match="not empty"):
        build_tiny_checkpoint(tmp_path / "used")
    with pytest.raises(CosyEdgeError, match="allowed: tiny, tiny2, full"):
        build_tiny_checkpoint(tmp_path / "new", size="huge")
    with pytest.raises(CosyEdgeError, match="unknown checkpoint size field"):
        build_tiny_checkpoint(tmp_path / "new2", hidden=3)
    # sizes the upstream modules reject: a clear error, and nothing left behind
    with pytest.raises(CheckpointError, match="building its llm/flow/hift failed"):
        build_tiny_checkpoint(tmp_path / "new3", encoder_heads=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used"]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    for p in src.rglob("*"):
        if p.is_file() and p.name != ".done":
            (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / p.relative_to(src)).write_bytes(p.read_bytes())
    return dst


def test_not_a_directory_or_empty(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_reference(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"missing cosyvoice2\.yaml, llm\.pt.*expected"):
        load_reference(tmp_path)


def test_cosyvoice1_yaml_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_model_dir, tmp_path / "m")
    yaml = model / "cosyvoice2.yaml"
    yaml.write_text(
        yaml.read_text().replace(
            "cosyvoice.flow.flow.CausalMaskedDiffWithXvec", "cosyvoice.flow.flow.MaskedDiffWithXvec"
        )
    )
    with pytest.raises(
        CheckpointError,
        match="'flow' is cosyvoice.flow.flow.MaskedDiffWithXvec, expected "
        "!new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec",
    ):
        load_reference(model)


def test_weights_of_another_model_are_refused(
    tiny_model_dir: Path, tiny2_model_dir: Path, tmp_path: Path
) -> None:
    model = copy_checkpoint(tiny_model_dir, tmp_path / "m")
    (model / "flow.pt").write_bytes((tiny2_model_dir / "flow.pt").read_bytes())
    with pytest.raises(
        CheckpointError, match="flow.pt does not match the flow that cosyvoice2.yaml describes"
    ):
        load_reference(model)
    (model / "flow.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="flow.pt is not a PyTorch state dict"):
        load_reference(model)


def test_broken_yaml_is_a_checkpoint_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_model_dir, tmp_path / "m")
    yaml = model / "cosyvoice2.yaml"
    yaml.write_text(
        yaml.read_text().replace(
            "    input_size: 512\n    output_size: 80",
            "    input_size: 512\n    output_size: 80\n    bogus_arg: 1",
            1,
        )
    )
    with pytest.raises(CheckpointError, match="building its llm/flow/hift failed"):
        load_reference(model)


def test_missing_extra_names_the_package() -> None:
    with pytest.raises(MissingExtraError, match=r"'no_such_package_xyz'.*cosyedge\[build\]"):
        require("no_such_package_xyz", "no_such_package_xyz", "testing")


def test_model_part_keeps_scalars_and_model_blocks(checkpoint: Checkpoint) -> None:
    part = reference.model_part((checkpoint.model_dir / "cosyvoice2.yaml").read_text())
    kept = list(reference.split_top_level(part))
    assert kept == [
        "sample_rate",
        "llm_input_size",
        "llm_output_size",
        "spk_embed_dim",
        "qwen_pretrain_path",
        "token_frame_rate",
        "token_mel_ratio",
        "chunk_size",
        "num_decoding_left_chunks",
        "llm",
        "flow",
        "hift",
        "allowed_special",
    ]


@pytest.mark.slow
def test_full_size_checkpoint_exports(tmp_path: Path) -> None:
    """The real CosyVoice2-0.5B dimensions load strictly and export
    (minutes, ~10 GB of memory, ~8 GB of disk)."""
    from cosyedge_build.export import export_bundle

    from tests.edge_build.export.test_parity_llm import cache_array, lm_input, upstream_prefill
    from tests.edge_build.parity import TOLERANCE, max_rel, to_numpy

    out = build_tiny_checkpoint(tmp_path / "full", size="full")
    refs = load_reference(out)
    config = refs.llm.llm.model.config
    dims = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads)
    assert dims + (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (
        896,
        24,
        14,
        2,
        4864,
        151936,
    )
    assert 4.5e8 < sum(p.numel() for p in refs.llm.parameters()) < 5.5e8
    blocks = reference.split_top_level((out / "cosyvoice2.yaml").read_text())
    assert "channels: [256]" in blocks["flow"] and "base_channels: 512" in blocks["hift"]
    bundle = export_bundle(out, tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["llm"]["hidden_size"] == 896 and manifest["llm"]["num_layers"] == 24
    assert not list(bundle.glob("*.data")), "fp32 0.5B graphs stay under protobuf's 2 GB"
    with torch.no_grad():
        x = lm_input(refs.llm, torch.arange(20)[None] * 7, torch.arange(10)[None] * 3)
        ref_logp, cache = upstream_prefill(refs.llm, x)
    session = ort.InferenceSession(str(bundle / "llm_prefill.onnx"))
    logp, kv = session.run(
        None, {"inputs_embeds": to_numpy(x), "attention_mask": np.ones((1, x.shape[1]), np.int64)}
    )
    assert max_rel(logp, to_numpy(ref_logp)) < TOLERANCE
    assert max_rel(kv, cache_array(cache)) < TOLERANCE
