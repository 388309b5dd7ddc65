"""Zoo entries from transformers: vision transformers, conv nets, speech encoders,
segmentation models and two-tower (image-text) models.

Images are 1x3x32x32 (2x3x32x32 for models with batch norm: train mode needs more than
one value per channel after global pooling), audio 1x1600 samples (Whisper: 16 mel bins x 32 frames); hidden
sizes 16-64, two stages or layers.  Batch-norm statistics are randomized so that eval mode
does not reduce them to the identity.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .hf_text import VOCAB, hf_model
from .registry import Built, KeywordAdapter, padding_mask, randn, register, token_ids


def randomize_batch_norms(model: nn.Module) -> nn.Module:
    """Running mean/variance and affine parameters of every batch norm set to seeded random
    values (fresh ones are 0/1, which hides a wrong normalization in eval mode)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
                if m.affine:
                    m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
    return model


def image_model(cls: type, config: Any, size: int = 32, batch: int = 1) -> Built:
    model = randomize_batch_norms(hf_model(cls, config))
    return KeywordAdapter(model, ("pixel_values",)), (randn(batch, 3, size, size),)


# ------------------------------------------------------------------ vision transformers

_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)


@register("vit", "vit", "vision", ("patch-embedding", "cls-token"))
def vit() -> Built:
    from transformers import ViTConfig, ViTModel

    return image_model(ViTModel, ViTConfig(**_VIT, attn_implementation="sdpa"))


@register("deit", "deit", "vision", ("distillation-token",))
def deit() -> Built:
    from transformers import DeiTConfig, DeiTForImageClassificationWithTeacher

    return image_model(DeiTForImageClassificationWithTeacher,
                       DeiTConfig(**_VIT, num_labels=10, attn_implementation="sdpa"))


@register("beit", "beit", "vision", ("relative-position-bias", "layer-scale", "mean-pooling"))
def beit() -> Built:
    from transformers import BeitConfig, BeitModel

    return image_model(BeitModel, BeitConfig(**_VIT, use_relative_position_bias=True, use_mean_pooling=True,
                                             layer_scale_init_value=0.1))


@register("swin", "swin", "vision", ("window-attention", "shifted-windows", "patch-merging"))
def swin() -> Built:
    from transformers import SwinConfig, SwinModel

    # 32x32 image, 4x4 patches: an 8x8 grid in windows of 4 (shifted by 2 in every second
    # block), merged to 4x4 for the second stage (one window there: no shift).
    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                        mlp_ratio=2.0)
    return image_model(SwinModel, config)


# ------------------------------------------------------------------ conv nets


@register("resnet", "resnet", "conv", ("batch-norm", "bottleneck", "max-pool"))
def resnet() -> Built:
    from transformers import ResNetConfig, ResNetModel

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck")
    return image_model(ResNetModel, config, batch=2)


@register("convnext", "convnext", "conv", ("depthwise-7x7", "channels-first-layer-norm", "layer-scale"))
def convnext() -> Built:
    from transformers import ConvNextConfig, ConvNextModel

    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                            layer_scale_init_value=0.5)
    return image_model(ConvNextModel, config)


@register("regnet", "regnet", "conv", ("grouped-conv", "squeeze-excitation", "batch-norm"))
def regnet() -> Built:
    from transformers import RegNetConfig, RegNetModel

    config = RegNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8,
                          layer_type="y")
    return image_model(RegNetModel, config, batch=2)


@register("mobilenet_v2", "mobilenet_v2", "conv", ("depthwise-conv", "inverted-residual", "relu6"))
def mobilenet_v2() -> Built:
    from transformers import MobileNetV2Config, MobileNetV2Model

    config = MobileNetV2Config(image_size=32, depth_multiplier=0.25, min_depth=4, finegrained_output=False)
    return image_model(MobileNetV2Model, config, batch=2)


# ------------------------------------------------------------------ speech encoders

_SPEECH = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=4, feat_extract_norm="group", vocab_size=VOCAB,
               mask_time_prob=0.0)


@register("wav2vec2", "wav2vec2", "speech", ("conv-front-end", "group-norm", "weight-norm", "grouped-conv"))
def wav2vec2() -> Built:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    model = hf_model(Wav2Vec2Model, Wav2Vec2Config(**_SPEECH, attn_implementation="sdpa"))
    return KeywordAdapter(model, ("input_values",)), (randn(1, 1600),)


@register("hubert", "hubert", "speech", ("conv-front-end", "group-norm", "weight-norm"))
def hubert() -> Built:
    from transformers import HubertConfig, HubertModel

    model = hf_model(HubertModel, HubertConfig(**_SPEECH, attn_implementation="sdpa"))
    return KeywordAdapter(model, ("input_values",)), (randn(1, 1600),)


@register("whisper_encoder", "whisper", "speech", ("conv1d-front-end", "sinusoidal-positions"))
def whisper_encoder() -> Built:
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
                           vocab_size=VOCAB, pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 2,
                           eos_token_id=VOCAB - 2, decoder_start_token_id=VOCAB - 3, attn_implementation="sdpa")
    encoder = hf_model(WhisperModel, config).get_encoder()
    return KeywordAdapter(encoder, ("input_features",)), (randn(1, 16, 32),)


# ------------------------------------------------------------------ segmentation


@register("segformer", "segformer", "segmentation", ("overlapping-patches", "efficient-attention",
                                                     "mix-ffn-depthwise", "bilinear-upsample"))
def segformer() -> Built:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                             patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                             decoder_hidden_size=32, num_labels=4)
    return image_model(SegformerForSemanticSegmentation, config, batch=2)


@register("upernet_convnext", "upernet", "segmentation", ("pyramid-pooling", "fpn", "adaptive-avg-pool",
                                                          "bilinear-upsample", "batch-norm"))
def upernet_convnext() -> Built:
    from transformers import (
        ConvNextConfig,
        UperNetConfig,
        UperNetForSemanticSegmentation,
    )

    backbone = ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, out_features=["stage1", "stage2"])
    config = UperNetConfig(backbone_config=backbone, hidden_size=16, pool_scales=[1, 2], num_labels=4,
                           use_auxiliary_head=False, auxiliary_in_channels=32)
    return image_model(UperNetForSemanticSegmentation, config, batch=2)


# ------------------------------------------------------------------ two towers


def _two_tower(model: nn.Module) -> Built:
    names = ("input_ids", "pixel_values", "attention_mask")
    return KeywordAdapter(model, names), (token_ids(VOCAB, 8, batch=2), randn(2, 3, 32, 32),
                                         padding_mask(8, batch=2, padded=2))


@register("clip", "clip", "two-tower", ("quick-gelu", "causal-text-mask", "logit-scale"))
def clip() -> Built:
    from transformers import CLIPConfig, CLIPModel

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
                max_position_embeddings=16)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, attn_implementation="sdpa")
    return _two_tower(hf_model(CLIPModel, config))


@register("siglip", "siglip", "two-tower", ("sigmoid-logits", "attention-pooling-head"))
def siglip() -> Built:
    from transformers import SiglipConfig, SiglipModel

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
                max_position_embeddings=16)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8)
    config = SiglipConfig(text_config=text, vision_config=vision, attn_implementation="sdpa")
    model = hf_model(SiglipModel, config)
    # SigLIP's text tower takes no attention mask in its reference usage (padding="max_length").
    return KeywordAdapter(model, ("input_ids", "pixel_values")), (token_ids(VOCAB, 8, batch=2), randn(2, 3, 32, 32))
