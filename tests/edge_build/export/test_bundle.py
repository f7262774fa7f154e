"""The bundle export against models/bundle/BUNDLE.md: files, hashes, every stage's
I/O as onnxruntime sees it, profiles, hyper-parameters read from the
checkpoint, voices, and what a failed export leaves behind."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyedge_build.export import export_bundle
from cosyedge_models.errors import CheckpointError, CosyEdgeError

from tests.conftest import BATCH_FLOW_SIZES, STATIC_FLOW_CACHE, STATIC_FLOW_WINDOWS
from tests.edge_build.conftest import Checkpoint

STAGES = ["llm_prefill", "llm_decode", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder"]
CARRIED = {"campplus": "campplus.onnx", "speech_tokenizer": "speech_tokenizer_v2.onnx"}
ARRAYS = {
    "text_embedding": "llm_text_embedding.npy",
    "speech_embedding": "llm_speech_embedding.npy",
    "special_embedding": "llm_special_embedding.npy",
    "flow_noise": "flow_noise.npy",
}
ORT_TYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(int32)": "int32"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_manifest_header_and_hashes(checkpoint: Checkpoint) -> None:
    m = load_manifest(checkpoint.bundle)
    assert (m["format"], m["format_version"], m["family"], m["cosyvoice_version"]) == (
        "cosyedge-bundle",
        2,
        "cosyvoice2",
        2,
    )
    assert m["precision"] == "fp32" and m["engines"] is None
    on_disk = {
        p.relative_to(checkpoint.bundle).as_posix()
        for p in checkpoint.bundle.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", ".done")
    }
    assert set(m["files"]) == on_disk
    for rel, digest in m["files"].items():
        assert sha256(checkpoint.bundle / rel) == digest, rel
    assert not list(checkpoint.bundle.glob("*.onnx.data")), "tiny graphs keep their weights inside"
    for name, file in CARRIED.items():  # carried as shipped
        assert (
            sha256(checkpoint.bundle / file)
            == sha256(checkpoint.model_dir / file)
            == m["stages"][name]["sha256"]
        )
    source = m["source"]
    assert Path(source["model_dir"]) == checkpoint.model_dir.resolve()
    for rel in ("llm.pt", "flow.pt", "hift.pt", "cosyvoice2.yaml", "CosyVoice-BlankEN/model.safetensors"):
        assert source["files"][rel] == sha256(checkpoint.model_dir / rel)
    build = m["build"]
    assert build["onnx_opset"] >= 17 and build["torch"] and build["created"].endswith("Z") and build["host"]


def test_stage_io_matches_onnx_files(checkpoint: Checkpoint) -> None:
    m = load_manifest(checkpoint.bundle)
    assert set(m["stages"]) == set(STAGES) | set(CARRIED)
    for name, stage in m["stages"].items():
        path = checkpoint.bundle / stage["file"]
        assert stage["sha256"] == sha256(path)
        model = onnx.load(str(path), load_external_data=False)
        if name in STAGES:
            assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
        session = checkpoint.session(stage["file"][: -len(".onnx")])
        for declared, actual in (
            (stage["inputs"], session.get_inputs()),
            (stage["outputs"], session.get_outputs()),
        ):
            assert [d["name"] for d in declared] == [a.name for a in actual], name
            for d, a in zip(declared, actual, strict=True):
                assert d["dtype"] == ORT_TYPES[a.type], (name, d["name"])
                assert [x if isinstance(x, int) else str(x) for x in d["shape"]] == [
                    x if isinstance(x, int) else str(x) for x in a.shape
                ], (name, d["name"])
        # every free symbolic input dim has a sane [min, opt, max]
        symbols = {
            s
            for d in stage["inputs"]
            for s in d["shape"]
            if isinstance(s, str) and re.fullmatch(r"[A-Za-z_]\w*", s)
        }
        profiles = stage["profile"] if isinstance(stage["profile"], list) else [stage["profile"]]
        for profile in profiles:
            assert symbols == set(profile), name
            for sym, (lo, opt, hi) in profile.items():
                # the flow estimator's cache lengths (S, R) are 0 offline, and so is llm_decode's
                # past in its prefill profile (one TensorRT engine for the whole LLM)
                empty_ok = sym in ("S", "R") or (name == "llm_decode" and sym == "P")
                assert (0 if empty_ok else 1) <= lo <= opt <= hi, (name, sym)


def test_profiles_fit_a_board(checkpoint: Checkpoint) -> None:
    stages = load_manifest(checkpoint.bundle)["stages"]
    step, prefill = stages["llm_decode"]["profile"]
    assert step["P"][2] >= 1024 + stages["llm_prefill"]["profile"]["T"][2] - 1
    # llm_decode takes T new positions (a prefill after a voice's cached LLM prefix); for TensorRT
    # one step profile (T = 1) and one prefill profile (an empty past or a saved prefix)
    decode_in = {s["name"]: s["shape"] for s in stages["llm_decode"]["inputs"]}
    assert decode_in["inputs_embeds"][1] == "T" and decode_in["attention_mask"][1] == "P+T"
    assert step["T"] == [1, 1, 1]
    assert prefill["P"][0] == 0 and prefill["T"] == stages["llm_prefill"]["profile"]["T"]
    enc_offline, enc_streaming = stages["flow_encoder"]["profile"]
    assert enc_offline["T"][2] * 2 >= 1500 and enc_offline["S"] == [0, 0, 0]  # 30 s of mel
    assert enc_streaming["S"][2] * 2 >= 1500
    offline, streaming = stages["flow_estimator"]["profile"]
    assert offline["T"][2] >= 1500 and offline["S"] == offline["R"] == [0, 0, 0]
    assert offline["N"][0] == streaming["N"][0] == 2  # CFG: conditional + unconditional
    assert streaming["S"][2] >= 1500 and streaming["R"][2] >= 1  # caches of a 30 s streaming request
    assert stages["hift_decoder"]["profile"]["T"][2] >= 1500


def test_hyperparameters_come_from_the_checkpoint(checkpoint: Checkpoint) -> None:
    m = load_manifest(checkpoint.bundle)
    refs = checkpoint.refs
    config = refs.llm.llm.model.config
    yaml_text = (checkpoint.model_dir / "cosyvoice2.yaml").read_text()
    llm = m["llm"]
    assert llm["hidden_size"] == config.hidden_size and llm["num_layers"] == config.num_hidden_layers
    assert llm["num_kv_heads"] == config.num_key_value_heads
    assert llm["head_dim"] == config.hidden_size // config.num_attention_heads
    assert llm["speech_token_size"] == 6561 and llm["speech_vocab_size"] == 6564 and llm["eos_token"] == 6561
    assert llm["text_vocab_size"] == config.vocab_size
    for key in ("top_p", "top_k", "win_size", "tau_r"):
        assert llm["sampling"][key] == float(re.search(rf"\n\s+{key}: ([\d.]+)", yaml_text).group(1))
    assert (llm["min_token_text_ratio"], llm["max_token_text_ratio"]) == (2.0, 20.0)
    flow = m["flow"]
    assert flow["n_timesteps"] == 10 and flow["inference_cfg_rate"] == 0.7 and flow["t_scheduler"] == "cosine"
    assert flow["pre_lookahead_len"] == 3 and flow["chunk_tokens"] == 25 and flow["chunk_frames"] == 50
    assert m["hift"]["upsample_factor"] == 480 and m["hift"]["harmonics"] == refs.hift.nb_harmonics + 1
    assert m["streaming"] == {"token_hop_len": 25, "mel_cache_len": 8, "source_cache_len": 8 * 480}
    assert (m["sample_rate"], m["token_rate_hz"], m["token_mel_ratio"], m["mel_bins"]) == (24000, 25, 2, 80)


def test_arrays(checkpoint: Checkpoint) -> None:
    m = load_manifest(checkpoint.bundle)
    refs = checkpoint.refs
    expected = {
        "text_embedding": refs.llm.llm.model.model.embed_tokens.weight,
        "speech_embedding": refs.llm.speech_embedding.weight,
        "special_embedding": refs.llm.llm_embedding.weight,
        "flow_noise": refs.flow.decoder.rand_noise[0],
    }
    for key, file in ARRAYS.items():
        entry = m["arrays"][key]
        array = np.load(checkpoint.bundle / file)
        assert entry["file"] == file and entry["sha256"] == sha256(checkpoint.bundle / file)
        assert entry["shape"] == list(array.shape) and array.dtype == np.float32
        assert np.array_equal(array, expected[key].detach().numpy())


def test_voices(checkpoint: Checkpoint) -> None:
    m = load_manifest(checkpoint.bundle)
    assert m["voices"] == {"default": "voices/default.npz"} and m["default_voice"] == "default"
    voice = np.load(checkpoint.bundle / "voices/default.npz")
    import torch

    spk2info = torch.load(checkpoint.model_dir / "spk2info.pt", weights_only=True)
    assert np.array_equal(voice["embedding"], spk2info["default"]["embedding"][0].numpy())
    assert voice["embedding"].shape == (192,) and voice["prompt_text"].dtype == np.int64
    assert voice["prompt_text"].size == voice["prompt_speech_token"].size == voice["prompt_feat"].size == 0
    assert voice["prompt_feat"].shape == (0, 80) and str(voice["prompt_transcript"]) == ""


def test_zero_shot_speaker_becomes_a_prompt_voice(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A zero-shot entry (as upstream's add_zero_shot_spk saves it) keeps its
    prompt tokens, speech tokens, mel and a decoded transcript."""
    import torch
    from cosyedge_build.export.tokenizer import export_tokenizer
    from cosyedge_build.export.voices import export_voices

    model = tmp_path / "ckpt"
    model.mkdir()
    for f in ("spk2info.pt",):
        (model / f).write_bytes((tiny_model_dir / f).read_bytes())
    tok_path, _ = export_tokenizer(tiny_model_dir, tmp_path)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tok_path)).encode("Hello world").ids
    entry = {
        "prompt_text": torch.tensor([ids]),
        "prompt_text_len": torch.tensor([len(ids)]),
        "llm_prompt_speech_token": torch.tensor([[5, 6, 7]]),
        "flow_prompt_speech_token": torch.tensor([[5, 6, 7]]),
        "prompt_speech_feat": torch.randn(1, 6, 80),
        "llm_embedding": torch.randn(1, 192),
        "flow_embedding": torch.randn(1, 192),
    }
    torch.save({"my voice/1": entry, "broken": {"text": "no embedding"}}, model / "spk2info.pt")
    out = tmp_path / "bundle"
    out.mkdir()
    voices = export_voices(model, out, 80, tok_path)
    assert voices == {"my voice/1": "voices/my_voice_1.npz"}
    v = np.load(out / voices["my voice/1"])
    assert v["prompt_text"].tolist() == ids and v["prompt_speech_token"].tolist() == [5, 6, 7]
    assert v["prompt_feat"].shape == (6, 80) and str(v["prompt_transcript"]) == "Hello world"
    assert np.array_equal(v["embedding"], entry["flow_embedding"][0].numpy())


def test_export_refuses_a_non_empty_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CosyEdgeError, match="not an empty directory"):
        export_bundle(tiny_model_dir, out)
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["missing", "not_cosyvoice2"])
def test_export_of_a_bad_dir_leaves_nothing(tiny_model_dir: Path, tmp_path: Path, damage: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if damage == "not_cosyvoice2":
        for p in tiny_model_dir.rglob("*"):
            if p.is_file():
                (model / p.relative_to(tiny_model_dir)).parent.mkdir(parents=True, exist_ok=True)
                (model / p.relative_to(tiny_model_dir)).write_bytes(p.read_bytes())
        yaml = model / "cosyvoice2.yaml"
        yaml.write_text(
            yaml.read_text().replace("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.TransformerLM")
        )
    with pytest.raises(CheckpointError, match="expected"):
        export_bundle(model, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_estimator_profiles_cover_offline_and_streaming_calls(checkpoint: Checkpoint) -> None:
    """TensorRT profiles of the cache-capable estimator: offline calls (any
    batch, empty cache) and streaming calls (one request, cache of up to 30 s)."""
    from cosyedge_build.tensorrt.engine_plan import batch_caps, build_profiles
    from cosyedge_models.backends.profiles import choose_profile

    entry = load_manifest(checkpoint.bundle)["stages"]["flow_estimator"]
    d = entry["cache"]
    c = entry["inputs"][0]["shape"][1]

    def shapes(n: int, t: int, s: int, r: int) -> dict[str, tuple[int, ...]]:
        return {"x": (n, c, t), "t": (n,), "att_cache": (s, d["blocks"], 2, n, d["heads"], d["head_dim"]),
                "conv_cache": (d["convs"], n, d["conv_channels"], d["conv_history"]), "commit": (r,)}

    profiles = build_profiles(entry, "flow_estimator", None)
    assert choose_profile(profiles, shapes(8, 1500, 0, 0), "flow_estimator") == 0
    assert choose_profile(profiles, shapes(2, 77, 1450, 50), "flow_estimator") == 1
    assert choose_profile(profiles, shapes(2, 300, 0, 0), "flow_estimator") in (0, 1)  # either covers it
    capped = build_profiles(entry, "flow_estimator", None, batch_caps(entry["profile"], 1))
    assert [p["att_cache"].max[3] for p in capped] == [2, 2]
    assert capped[1]["att_cache"].max[0] >= 1500 and capped[0]["att_cache"].max[0] == 0


def test_export_with_the_flow_beside_the_llm_writes_the_same_bundle(
        tiny_model_dir: Path, static_flow_bundle: Path, tmp_path: Path) -> None:
    """--jobs 2 (the flow and the vocoder in a second process) writes what one process writes: the same
    stages in the same order, every file with the same sha256."""
    out = export_bundle(tiny_model_dir, tmp_path / "b", static_flow_windows=STATIC_FLOW_WINDOWS,
                        static_flow_cache=STATIC_FLOW_CACHE, batch_flow_sizes=BATCH_FLOW_SIZES, jobs=2)
    one, two = (json.loads((b / "manifest.json").read_text()) for b in (static_flow_bundle, out))
    assert list(two["stages"]) == list(one["stages"])
    assert len(one["stages"]) > 10  # the flow's windows, batched and not, are among them
    for name in ("stages", "arrays"):
        assert two[name] == one[name], name
    assert {k: v for k, v in two.items() if k != "build"} == {k: v for k, v in one.items() if k != "build"}


def test_export_refuses_more_than_two_jobs(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be 1 or 2"):
        export_bundle(tiny_model_dir, tmp_path / "b", jobs=3)
    assert not (tmp_path / "b").exists()
