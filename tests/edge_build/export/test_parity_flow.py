"""flow_encoder / flow_estimator in onnxruntime against upstream's
CausalMaskedDiffWithXvec: the encoder output that flow.inference hands to the
CFM (captured with hooks, for finalize and streaming on and off, padded batch
rows included), the estimator in both attention modes, and the whole
token -> mel step (our graphs + flow_noise.npy in the Euler loop)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from cosyedge_models.synthesis.api import SynthesisRequest

from tests.edge_build.conftest import Checkpoint
from tests.edge_build.parity import TOLERANCE, empty_encoder_caches, empty_estimator_caches, max_rel, to_numpy


class _Captured(Exception):
    """Raised from the decoder hook to skip the CFM when only its inputs matter."""


def upstream_inference(
    flow: Any,
    prompt: torch.Tensor,
    tokens: torch.Tensor,
    embedding: torch.Tensor,
    prompt_feat: torch.Tensor,
    streaming: bool,
    finalize: bool,
    with_mel: bool = False,
) -> dict[str, Any]:
    """Run flow.inference and capture the encoder_proj output and the
    arguments it passes to the CFM decoder (and the mel, if asked)."""
    seen: dict[str, Any] = {}

    def before_decoder(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen["kw"] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
        if not with_mel:
            raise _Captured

    hooks = [
        flow.encoder_proj.register_forward_hook(
            lambda m, a, out: seen.__setitem__("h", out.detach().clone())
        ),
        flow.decoder.register_forward_pre_hook(before_decoder, with_kwargs=True),
    ]
    try:
        mel, _ = flow.inference(
            token=tokens,
            token_len=torch.tensor([tokens.shape[1]]),
            prompt_token=prompt,
            prompt_token_len=torch.tensor([prompt.shape[1]]),
            prompt_feat=prompt_feat,
            prompt_feat_len=torch.tensor([prompt_feat.shape[1]]),
            embedding=embedding,
            streaming=streaming,
            finalize=finalize,
        )
        seen["mel"] = to_numpy(mel[0])
    except _Captured:
        pass
    finally:
        for h in hooks:
            h.remove()
    return {
        "mu": to_numpy(seen["h"][0]).T,
        "spks": to_numpy(seen["kw"]["spks"][0]),
        "mel": seen.get("mel"),
        "cond": to_numpy(seen["kw"]["cond"][0]),
    }


def manifest(checkpoint: Checkpoint) -> dict[str, Any]:
    return json.loads((checkpoint.bundle / "manifest.json").read_text())


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("finalize", [True, False])
def test_encoder_matches_flow_inference(checkpoint: Checkpoint, streaming: bool, finalize: bool) -> None:
    flow = checkpoint.refs.flow
    flow_cfg = manifest(checkpoint)["flow"]
    g = torch.Generator().manual_seed(11)
    rows = []
    for n_prompt, n_tokens in ((6, 31), (0, 58), (12, 9)):
        prompt = torch.randint(0, flow.vocab_size, (1, n_prompt), generator=g)
        tokens = torch.randint(0, flow.vocab_size, (1, n_tokens), generator=g)
        embedding = torch.randn(1, flow.spk_embed_affine_layer.in_features, generator=g)
        feat = torch.randn(1, 2 * n_prompt, flow.output_size, generator=g)
        ref = upstream_inference(flow, prompt, tokens, embedding, feat, streaming, finalize)
        rows.append((torch.cat([prompt, tokens], dim=1)[0].numpy(), to_numpy(embedding[0]), ref))
    t = max(len(r[0]) for r in rows)
    token = np.zeros((len(rows), t), np.int64)
    for i, r in enumerate(rows):
        token[i, : len(r[0])] = r[0]
    feeds = {
        "token": token,
        "token_len": np.array([len(r[0]) for r in rows], np.int64),
        "lookahead_len": np.full(len(rows), 0 if finalize else flow_cfg["pre_lookahead_len"], np.int64),
        "chunk_tokens": np.full(len(rows), flow_cfg["chunk_tokens"] if streaming else 0, np.int64),
        "embedding": np.stack([r[1] for r in rows]),
    }
    enc = checkpoint.session("flow_encoder")
    mu, spks = enc.run(["mu", "spks"], {**feeds, **empty_encoder_caches(manifest(checkpoint), len(rows))})
    assert mu.shape == (len(rows), flow.output_size, 2 * t)
    for i, (_, _, ref) in enumerate(rows):
        frames = ref["mu"].shape[1]
        assert frames == 2 * (feeds["token_len"][i] - feeds["lookahead_len"][i])
        assert max_rel(mu[i, :, :frames], ref["mu"]) < TOLERANCE
        assert max_rel(spks[i], ref["spks"]) < TOLERANCE
        # each padded row also equals that row run alone
        alone = enc.run(
            ["mu"],
            {
                **{k: (v[i : i + 1, : len(rows[i][0])] if k == "token" else v[i : i + 1]) for k, v in feeds.items()},
                **empty_encoder_caches(manifest(checkpoint)),
            },
        )[0]
        assert max_rel(mu[i, :, :frames], alone[0, :, :frames]) < TOLERANCE


@pytest.mark.parametrize("streaming", [False, True])
def test_estimator_matches_upstream(checkpoint: Checkpoint, streaming: bool) -> None:
    """Batch 2 as solve_euler builds it (unconditional half zeroed), and
    a padded row against the same row alone."""
    estimator = checkpoint.refs.flow.decoder.estimator
    chunk = manifest(checkpoint)["flow"]["chunk_frames"] if streaming else 0
    g = torch.Generator().manual_seed(12)
    c = estimator.out_channels
    for frames in (37, 118):
        x, mu, cond = (torch.randn(2, c, frames, generator=g) for _ in range(3))
        spks, t, mask = (
            torch.randn(2, c, generator=g),
            torch.rand(1, generator=g).expand(2),
            torch.ones(2, 1, frames),
        )
        mu[1], cond[1], spks[1] = 0, 0, 0
        with torch.no_grad():
            ref = estimator(x, mask, mu, t.contiguous(), spks, cond, streaming=streaming)
        feeds = {
            "x": to_numpy(x),
            "mask": to_numpy(mask),
            "mu": to_numpy(mu),
            "t": to_numpy(t).copy(),
            "spks": to_numpy(spks),
            "cond": to_numpy(cond),
            "chunk_frames": np.full(2, chunk, np.int64),
            **empty_estimator_caches(manifest(checkpoint)),
        }
        out = checkpoint.session("flow_estimator").run(["dphi_dt"], feeds)[0]
        assert max_rel(out, to_numpy(ref)) < TOLERANCE
        valid = frames - 13
        feeds["mask"][0, :, valid:] = 0
        padded = checkpoint.session("flow_estimator").run(["dphi_dt"], feeds)[0]
        with torch.no_grad():
            alone = estimator(
                x[:1, :, :valid],
                mask[:1, :, :valid],
                mu[:1, :, :valid],
                t[:1].contiguous(),
                spks[:1],
                cond[:1, :, :valid],
                streaming=streaming,
            )
        assert max_rel(padded[0, :, :valid], to_numpy(alone[0])) < TOLERANCE
        assert np.abs(padded[0, :, valid:]).max() == 0.0


def euler_with_graphs(
    checkpoint: Checkpoint, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, chunk_frames: int
) -> np.ndarray:
    """The CFM sampler of upstream's CausalConditionalCFM on our estimator graph
    (the loop models/ runs): fixed noise, cosine schedule, guidance."""
    cfg = manifest(checkpoint)["flow"]
    noise = np.load(checkpoint.bundle / "flow_noise.npy")
    frames = mu.shape[-1]
    x = noise[None, :, :frames] * cfg["temperature"]
    t_span = np.linspace(0, 1, cfg["n_timesteps"] + 1, dtype=np.float32)
    t_span = (1 - np.cos(t_span * 0.5 * math.pi)).astype(np.float32)
    t, dt = t_span[0], t_span[1] - t_span[0]
    zeros = np.zeros_like(mu)
    caches = empty_estimator_caches(manifest(checkpoint))
    for step in range(1, len(t_span)):
        (d,) = checkpoint.session("flow_estimator").run(
            ["dphi_dt"],
            {
                "x": np.concatenate([x, x]).astype(np.float32),
                "mask": np.ones((2, 1, frames), np.float32),
                "mu": np.concatenate([mu, zeros]),
                "t": np.array([t, t], np.float32),
                "spks": np.concatenate([spks, np.zeros_like(spks)]),
                "cond": np.concatenate([cond, zeros]),
                "chunk_frames": np.full(2, chunk_frames, np.int64),
                **caches,
            },
        )
        d = (1.0 + cfg["inference_cfg_rate"]) * d[:1] - cfg["inference_cfg_rate"] * d[1:]
        x = x + dt * d
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return x[0]


@pytest.mark.parametrize("streaming", [False, True])
def test_tokens_to_mel_matches_flow_inference(checkpoint: Checkpoint, streaming: bool) -> None:
    flow = checkpoint.refs.flow
    cfg = manifest(checkpoint)["flow"]
    g = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, flow.vocab_size, (1, 8), generator=g)
    tokens = torch.randint(0, flow.vocab_size, (1, 30), generator=g)
    embedding = torch.randn(1, 192, generator=g)
    feat = torch.randn(1, 16, flow.output_size, generator=g)
    ref = upstream_inference(flow, prompt, tokens, embedding, feat, streaming, finalize=True, with_mel=True)
    token = torch.cat([prompt, tokens], dim=1).numpy()
    mu, spks = checkpoint.session("flow_encoder").run(
        ["mu", "spks"],
        {
            "token": token,
            "token_len": np.array([token.shape[1]]),
            "lookahead_len": np.zeros(1, np.int64),
            "chunk_tokens": np.array([cfg["chunk_tokens"] if streaming else 0]),
            "embedding": to_numpy(embedding),
            **empty_encoder_caches(manifest(checkpoint)),
        },
    )
    cond = np.zeros_like(mu)
    cond[0, :, :16] = to_numpy(feat[0]).T
    assert max_rel(cond[0], ref["cond"]) == 0.0
    mel = euler_with_graphs(checkpoint, mu, spks, cond, cfg["chunk_frames"] if streaming else 0)
    assert max_rel(mel[:, 16:], ref["mel"]) < TOLERANCE


def test_estimator_caches_match_upstream_streaming(checkpoint: Checkpoint) -> None:
    """Streaming with caches: each call gets only the frames from the last
    committed mask chunk on (unaligned ends included: the unfinished chunk is
    recomputed), and its output equals upstream's streaming estimator over
    the whole prefix. A multi-level U-Net (tiny2) is not chunk-causal, and its
    manifest says so."""
    m = manifest(checkpoint)
    dims = m["stages"]["flow_estimator"]["cache"]
    estimator = checkpoint.refs.flow.decoder.estimator
    chunk = m["flow"]["chunk_frames"]
    if not dims["stream_cache"]:
        # tiny2: the manifest's "no stream cache" must be true: upstream's streaming
        # estimator is not chunk-causal there (later frames change earlier outputs),
        # so a cache would be wrong and the runtime recomputes the prefix instead.
        assert len(estimator.down_blocks) > 1
        g = torch.Generator().manual_seed(14)
        c, total = estimator.out_channels, 2 * chunk + 30
        x, mu, cond = (torch.randn(1, c, total, generator=g) for _ in range(3))
        spks, t = torch.randn(1, c, generator=g), torch.rand(1, generator=g)
        with torch.no_grad():
            short = estimator(x[:, :, :chunk], torch.ones(1, 1, chunk), mu[:, :, :chunk], t, spks,
                              cond[:, :, :chunk], streaming=True)
            long = estimator(x, torch.ones(1, 1, total), mu, t, spks, cond, streaming=True)
        assert max_rel(to_numpy(short), to_numpy(long[:, :, :chunk])) > 1e-3
        return
    g = torch.Generator().manual_seed(14)
    c, total = estimator.out_channels, 2 * chunk + 30
    x, mu, cond = (torch.randn(2, c, total, generator=g) for _ in range(3))
    spks, t = torch.randn(2, c, generator=g), torch.rand(1, generator=g).expand(2).contiguous()
    mu[1], cond[1], spks[1] = 0, 0, 0
    caches = empty_estimator_caches(m)
    start = emitted = 0
    for end in (37, chunk + 14, 2 * chunk, total):
        w = slice(start, end)
        commit = (end - start) // chunk * chunk
        feeds = {
            "x": to_numpy(x[:, :, w]), "mask": np.ones((2, 1, end - start), np.float32), "mu": to_numpy(mu[:, :, w]),
            "t": to_numpy(t), "spks": to_numpy(spks), "cond": to_numpy(cond[:, :, w]),
            "chunk_frames": np.full(2, chunk, np.int64), **caches, "commit": np.zeros(commit, np.float32),
        }
        out, att_new, conv_new = checkpoint.session("flow_estimator").run(None, feeds)
        with torch.no_grad():
            ref = estimator(x[:, :, :end], torch.ones(2, 1, end), mu[:, :, :end], t, spks, cond[:, :, :end],
                            streaming=True)
        assert max_rel(out[:, :, emitted - start:], to_numpy(ref[:, :, emitted:])) < TOLERANCE, end
        assert att_new.shape[0] == commit and conv_new.shape == caches["conv_cache"].shape
        caches["att_cache"] = np.concatenate([caches["att_cache"], att_new])
        caches["conv_cache"] = conv_new
        start, emitted = start + commit, end


def test_flow_stream_matches_the_full_prefix_pass_on_both_checkpoints(checkpoint: Checkpoint) -> None:
    """The runtime's FlowStream: with caches where the manifest allows them
    (tiny), recomputing the prefix where it does not (tiny2), the chunks are
    upstream's full-prefix streaming chunks."""
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    engine = load_synthesizer(checkpoint.bundle)
    try:
        dims = manifest(checkpoint)["stages"]["flow_estimator"]["cache"]
        voice = engine.conditioning.build(SynthesisRequest(text="x")).flow
        toks = np.arange(110) % engine.bundle.llm.speech_token_size
        stream = engine.flow.stream(voice, "cached")
        assert stream.cached == dims["stream_cache"]
        start = 0
        for end in (28, 41, 78, 103):
            got = stream.push(toks[:end])
            if stream.cached:  # the cached path against our own full-prefix pass (itself upstream's, above)
                old = engine.flow.mel(toks[:end], voice, finalize=False, streaming=True)[:, :, 2 * start:]
                assert got.shape == old.shape and np.abs(got - old).max() < 2e-5
            else:  # tiny2 recomputes the prefix with flow.mel: compare with upstream itself, not with flow.mel
                up = upstream_inference(
                    checkpoint.refs.flow, torch.from_numpy(voice.tokens[None]), torch.from_numpy(toks[None, :end]),
                    torch.from_numpy(voice.embedding[None]), torch.from_numpy(voice.feat[None]),
                    streaming=True, finalize=False, with_mel=True)["mel"][:, 2 * start:]
                assert got.shape[1:] == up.shape and max_rel(got[0], up) < TOLERANCE, end
            start = end - engine.bundle.flow.pre_lookahead_len
    finally:
        engine.close()


def test_encoder_caches_match_the_full_prefix(checkpoint: Checkpoint) -> None:
    """Streaming encoder with caches: each call takes only the tokens from the
    last committed chunk on (plus the look-ahead), and its mu equals the
    streaming encoder over the whole prefix (itself upstream's, tested above)."""
    m = manifest(checkpoint)
    cfg = m["flow"]
    chunk, look = cfg["chunk_tokens"], cfg["pre_lookahead_len"]
    enc = checkpoint.session("flow_encoder")
    g = torch.Generator().manual_seed(15)
    tokens = torch.randint(0, checkpoint.refs.flow.vocab_size, (1, 4 * chunk + 20), generator=g).numpy()
    embedding = torch.randn(1, checkpoint.refs.flow.spk_embed_affine_layer.in_features, generator=g).numpy()

    def run(tok: np.ndarray, lookahead: int, caches: dict[str, np.ndarray]) -> list[np.ndarray]:
        feeds = {"token": tok, "token_len": np.array([tok.shape[1]]), "lookahead_len": np.array([lookahead]),
                 "chunk_tokens": np.array([chunk]), "embedding": embedding, **caches}
        return enc.run(["mu", "enc_cache_new", "up_cache_new", "pre_cache_new", "upconv_cache_new"], feeds)

    caches = empty_encoder_caches(m)
    start = 0
    for end, final in ((chunk + 12, False), (2 * chunk, False), (3 * chunk + 7, False), (tokens.shape[1], True)):
        lookahead = 0 if final else look
        full = run(tokens[:, : end + lookahead], lookahead, empty_encoder_caches(m))[0][:, :, : 2 * end]
        main = end - start
        commit = 0 if final else main // chunk * chunk
        mu, enc_new, up_new, pre_new, upconv_new = run(
            tokens[:, start : end + lookahead], lookahead, {**caches, "commit": np.zeros(commit, np.float32)}
        )
        assert max_rel(mu[:, :, : 2 * main], full[:, :, 2 * start :]) < TOLERANCE, end
        assert enc_new.shape[0] == commit and up_new.shape[0] == 2 * commit
        caches["enc_cache"] = np.concatenate([caches["enc_cache"], enc_new])
        caches["up_cache"] = np.concatenate([caches["up_cache"], up_new])
        caches["pre_cache"], caches["upconv_cache"] = pre_new, upconv_new
        start += commit
