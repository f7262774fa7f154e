"""Speech tokens to mel: the flow encoder graph and the conditional flow
matching (CFM) Euler solver with classifier-free guidance over the estimator
graph, as upstream `CausalMaskedDiffWithXvec.inference` and
`CausalConditionalCFM` do it (fixed start noise, cosine time schedule)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.backends.base import Session
from models.bundle import Bundle, FlowConfig


@dataclass(frozen=True)
class FlowPrompt:
    """The flow's conditioning from the voice: prompt speech tokens, their mel
    (2 frames per token) and the speaker embedding."""

    tokens: np.ndarray  # [Tp] int64
    feat: np.ndarray  # [2 * Tp, C] float32
    embedding: np.ndarray  # [E] float32


def time_span(n_timesteps: int, scheduler: str) -> np.ndarray:
    t = np.linspace(0.0, 1.0, n_timesteps + 1, dtype=np.float32)
    if scheduler == "cosine":
        t = (1.0 - np.cos(t * np.float32(0.5 * np.pi))).astype(np.float32)
    return t


class FlowDecoder:
    def __init__(self, bundle: Bundle, encoder: Session, estimator: Session) -> None:
        self.config: FlowConfig = bundle.flow
        self.mel_bins = bundle.mel_bins
        self.token_mel_ratio = bundle.token_mel_ratio
        self.encoder = encoder
        self.estimator = estimator
        self.noise = np.asarray(bundle.array("flow_noise", mmap=False), dtype=np.float32)
        self.t_span = time_span(self.config.n_timesteps, self.config.t_scheduler)

    def encode(self, tokens: np.ndarray, embedding: np.ndarray, lookahead: int, chunk_tokens: int) -> tuple[
            np.ndarray, np.ndarray]:
        """mu [1, C, frames] for all but the look-ahead tokens, spks [1, C]."""
        n = tokens.shape[0]
        out = self.encoder.run({
            "token": tokens[None].astype(np.int64, copy=False),
            "token_len": np.array([n], dtype=np.int64),
            "lookahead_len": np.array([lookahead], dtype=np.int64),
            "chunk_tokens": np.array([chunk_tokens], dtype=np.int64),
            "embedding": embedding[None].astype(np.float32, copy=False),
        })
        frames = self.token_mel_ratio * (n - lookahead)
        return out["mu"][:, :, :frames], out["spks"]

    def solve(self, mu: np.ndarray, spks: np.ndarray, prompt_feat: np.ndarray, chunk_frames: int) -> np.ndarray:
        """Euler steps from the fixed noise; returns the mel of all frames
        (prompt included) [1, C, frames]."""
        frames = mu.shape[2]
        if frames > self.noise.shape[1]:
            raise ValueError(f"{frames} mel frames exceed the flow noise table ({self.noise.shape[1]})")
        c = self.mel_bins
        x = self.noise[None, :, :frames].copy()
        cond = np.zeros((1, c, frames), dtype=np.float32)
        n_prompt = prompt_feat.shape[0]
        if n_prompt:
            cond[0, :, :n_prompt] = prompt_feat.T
        # Conditional row 0, unconditional row 1 (zeros), as upstream's solve_euler.
        mask_in = np.ones((2, 1, frames), dtype=np.float32)
        mu_in = np.zeros((2, c, frames), dtype=np.float32)
        mu_in[0] = mu[0]
        spks_in = np.zeros((2, c), dtype=np.float32)
        spks_in[0] = spks[0]
        cond_in = np.zeros((2, c, frames), dtype=np.float32)
        cond_in[0] = cond[0]
        chunk_in = np.full((2,), chunk_frames, dtype=np.int64)
        rate = np.float32(self.config.inference_cfg_rate)
        t_span = self.t_span
        t = t_span[0]
        dt = t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            x_in = np.concatenate([x, x], axis=0)
            t_in = np.full((2,), t, dtype=np.float32)
            d = self.estimator.run({
                "x": x_in, "mask": mask_in, "mu": mu_in, "t": t_in, "spks": spks_in,
                "cond": cond_in, "chunk_frames": chunk_in,
            })["dphi_dt"]
            guided = (np.float32(1.0) + rate) * d[:1] - rate * d[1:]
            x = (x + dt * guided).astype(np.float32, copy=False)
            t = np.float32(t + dt)
            if step < len(t_span) - 1:
                dt = np.float32(t_span[step + 1] - t)
        return x

    def mel(self, tokens: np.ndarray, prompt: FlowPrompt, finalize: bool, streaming: bool) -> np.ndarray:
        """Mel frames [1, C, frames] for `tokens` (prompt excluded), as upstream
        `flow.inference(..., streaming, finalize)`."""
        all_tokens = np.concatenate([prompt.tokens.astype(np.int64), tokens.astype(np.int64)])
        lookahead = 0 if finalize else self.config.pre_lookahead_len
        chunk = self.config.chunk_tokens if streaming else 0
        mu, spks = self.encode(all_tokens, prompt.embedding, lookahead, chunk)
        feat = self.solve(mu, spks, prompt.feat, chunk * self.token_mel_ratio)
        return feat[:, :, prompt.feat.shape[0]:]
