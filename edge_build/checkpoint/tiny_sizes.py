"""Sizes of the checkpoints `cosyedge build tiny` writes, and the
cosyvoice2.yaml they go into (the structure and sections of upstream's
examples/libritts/cosyvoice2/conf/cosyvoice2.yaml)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cosyedge_models.errors import CosyEdgeError


@dataclass(frozen=True)
class CheckpointSizes:
    # Qwen2 (CosyVoice-BlankEN)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    text_vocab_size: int | None  # None: the tokenizer plus CosyVoice's special tokens, rounded up to 64
    bpe_vocab_size: int
    # flow encoder (its 512 channels are hard-coded upstream) and CFM estimator
    encoder_heads: int
    encoder_linear_units: int
    encoder_blocks: int
    estimator_channels: tuple[int, ...]
    estimator_head_dim: int
    estimator_heads: int
    estimator_blocks: int
    estimator_mid_blocks: int
    # HiFT vocoder
    hift_base_channels: int
    hift_harmonics: int
    hift_resblock_kernel_sizes: tuple[int, ...]
    hift_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    hift_source_resblock_kernel_sizes: tuple[int, ...]
    hift_source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    f0_cond_channels: int
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-06
    max_position_embeddings: int = 32768
    speech_token_size: int = 6561
    # LLM head init: logit spread and EOS bias (how often the random LLM stops)
    llm_logit_std: float = 2.0
    llm_eos_bias: float = 4.0

    def with_overrides(self, **overrides: Any) -> CheckpointSizes:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise CosyEdgeError(
                f"unknown checkpoint size field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **overrides)


PRESETS: dict[str, CheckpointSizes] = {
    "tiny": CheckpointSizes(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        text_vocab_size=None,
        bpe_vocab_size=1000,
        encoder_heads=4,
        encoder_linear_units=256,
        encoder_blocks=2,
        estimator_channels=(64,),
        estimator_head_dim=32,
        estimator_heads=2,
        estimator_blocks=1,
        estimator_mid_blocks=2,
        hift_base_channels=32,
        hift_harmonics=8,
        hift_resblock_kernel_sizes=(3, 7),
        hift_resblock_dilation_sizes=((1, 3), (1, 3)),
        hift_source_resblock_kernel_sizes=(7, 7, 11),
        hift_source_resblock_dilation_sizes=((1, 3), (1, 3), (1, 3)),
        f0_cond_channels=32,
    ),
    # another small shape: other head counts and head dims, a two-level
    # estimator U-Net, fewer harmonics, three vocoder resblocks
    "tiny2": CheckpointSizes(
        hidden_size=96,
        num_layers=3,
        num_heads=3,
        num_kv_heads=1,
        intermediate_size=160,
        text_vocab_size=None,
        bpe_vocab_size=1400,
        encoder_heads=8,
        encoder_linear_units=128,
        encoder_blocks=1,
        estimator_channels=(32, 48),
        estimator_head_dim=16,
        estimator_heads=3,
        estimator_blocks=2,
        estimator_mid_blocks=1,
        hift_base_channels=48,
        hift_harmonics=6,
        hift_resblock_kernel_sizes=(3, 5, 7),
        hift_resblock_dilation_sizes=((1, 2), (1, 2), (1, 2)),
        hift_source_resblock_kernel_sizes=(5, 7, 9),
        hift_source_resblock_dilation_sizes=((1, 2), (1, 2), (1, 2)),
        f0_cond_channels=24,
        rope_theta=10000.0,
    ),
    # the real CosyVoice2-0.5B: Qwen2-0.5B plus upstream's flow and hift
    "full": CheckpointSizes(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        text_vocab_size=151936,
        bpe_vocab_size=4000,
        encoder_heads=8,
        encoder_linear_units=2048,
        encoder_blocks=6,
        estimator_channels=(256,),
        estimator_head_dim=64,
        estimator_heads=8,
        estimator_blocks=4,
        estimator_mid_blocks=12,
        hift_base_channels=512,
        hift_harmonics=8,
        hift_resblock_kernel_sizes=(3, 7, 11),
        hift_resblock_dilation_sizes=((1, 3, 5),) * 3,
        hift_source_resblock_kernel_sizes=(7, 7, 11),
        hift_source_resblock_dilation_sizes=((1, 3, 5),) * 3,
        f0_cond_channels=512,
    ),
}


def _list(values: tuple[Any, ...]) -> str:
    return "[" + ", ".join(_list(v) if isinstance(v, tuple) else str(v) for v in values) + "]"


def render_yaml(s: CheckpointSizes) -> str:
    """cosyvoice2.yaml for these sizes: upstream's sections, our numbers."""
    return _TEMPLATE.format(
        hidden=s.hidden_size,
        speech_tokens=s.speech_token_size,
        enc_heads=s.encoder_heads,
        enc_units=s.encoder_linear_units,
        enc_blocks=s.encoder_blocks,
        est_channels=_list(s.estimator_channels),
        est_head_dim=s.estimator_head_dim,
        est_heads=s.estimator_heads,
        est_blocks=s.estimator_blocks,
        est_mid=s.estimator_mid_blocks,
        hift_base=s.hift_base_channels,
        harmonics=s.hift_harmonics,
        res_k=_list(s.hift_resblock_kernel_sizes),
        res_d=_list(s.hift_resblock_dilation_sizes),
        src_k=_list(s.hift_source_resblock_kernel_sizes),
        src_d=_list(s.hift_source_resblock_dilation_sizes),
        f0_cond=s.f0_cond_channels,
    )


_TEMPLATE = """\
# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: 24000
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

# stream related params
chunk_size: 25 # streaming inference chunk size, in token
num_decoding_left_chunks: -1 # streaming inference flow decoder left chunk size, <0 means use all left chunks

# model params
llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {speech_tokens}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {speech_tokens}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: {enc_heads}
        linear_units: {enc_units}
        num_blocks: {enc_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: {est_channels}
            dropout: 0.0
            attention_head_dim: {est_head_dim}
            n_blocks: {est_blocks}
            num_mid_blocks: {est_mid}
            num_heads: {est_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {hift_base}
    nb_harmonics: {harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: {res_k}
    resblock_dilation_sizes: {res_d}
    source_resblock_kernel_sizes: {src_k}
    source_resblock_dilation_sizes: {src_d}
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {f0_cond}

# gan related module
mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

# processor functions
parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 6000
    min_length: 100
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24480 # must be a multiplier of hop_size
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
    num_frames: 960
compute_whisper_fbank: !name:cosyvoice.dataset.processor.compute_whisper_fbank
    num_frames: 960
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: 480
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500  # sort_size should be less than shuffle_size
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False # change to True during sft


# dataset processor pipeline
data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <compute_whisper_fbank>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]
data_pipeline_gan: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <truncate>,
    !ref <compute_fbank>,
    !ref <compute_f0>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

# llm flow train conf
train_conf:
    optim: adam
    optim_conf:
        lr: 1e-5 # change to 1e-5 during sft
    scheduler: constantlr # change to constantlr during sft
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1

# gan train conf
train_conf_gan:
    optim: adam
    optim_conf:
        lr: 0.0002 # use small lr for gan training
    scheduler: constantlr
    optim_d: adam
    optim_conf_d:
        lr: 0.0002 # use small lr for gan training
    scheduler_d: constantlr
    max_epoch: 200
    grad_clip: 5
    accum_grad: 1 # in gan training, accum_grad must be 1
    log_interval: 100
    save_per_step: -1
"""
