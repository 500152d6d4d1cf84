"""The Transformer encoder-decoder for translation (Vaswani et al. 2017), with cached decoding.

Sinusoidal positions (§3.5), embeddings scaled by ``sqrt(d_model)`` (§3.4), pre-norm layers by
default. The paper's sizes (Table 3) are ``init_args`` blocks of the shipped configs: base is
``d_model 512, num_heads 8, ffn_dim 2048, num_layers 6, dropout 0.1``
(configs/translation/iwslt14_de_en_transformer_base_mos.yaml), big is ``1024, 16, 4096, 6, 0.3``
(configs/translation/wmt14_*_transformer_big_mixtape.yaml).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from datamodules.bpe import PAD_ID
from tasks.decoding import DECODE_LIMIT
from heads.validation import check_dropout, check_positive_int
from tasks.encoders.seq2seq import NETWORK, Seq2SeqNetwork


def sinusoidal_positions(length: int, width: int) -> Tensor:
    """Vaswani §3.5: ``PE(pos, 2i) = sin(pos / 10000^(2i/d))``, cos on odd dims. ``(length, width)``."""
    position = torch.arange(length, dtype=torch.float).unsqueeze(1)  # (T, 1)
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: width // 2])
    return table


class TransformerSeq2Seq(Seq2SeqNetwork):
    """Transformer encoder-decoder; the decoder's last-layer states go to the head.

    Args:
        source_vocab_size / target_vocab_size: linked from the data by the task.
        d_model: model width (embeddings, attention, the head's input).
        num_heads: attention heads (must divide ``d_model``).
        ffn_dim: feed-forward width.
        num_layers: encoder and decoder layers.
        dropout: on embeddings and inside every layer.
        norm_first: pre-norm layers (with a final layer norm) instead of the paper's post-norm.
    """

    def __init__(self, source_vocab_size: int, target_vocab_size: int, d_model: int = 256, num_heads: int = 4, ffn_dim: int = 1024,
                 num_layers: int = 2, dropout: float = 0.2, norm_first: bool = True) -> None:
        super().__init__()
        for key, value in (("d_model", d_model), ("num_heads", num_heads), ("ffn_dim", ffn_dim), ("num_layers", num_layers)):
            check_positive_int(value, key, "TransformerSeq2Seq", where=NETWORK)
        check_dropout(dropout, "dropout", "TransformerSeq2Seq", where=NETWORK)
        if d_model % num_heads or d_model % 2:
            raise ValueError(
                f"TransformerSeq2Seq needs an even d_model divisible by num_heads, got d_model={d_model}, num_heads={num_heads} "
                f"(set model.init_args.network.init_args.d_model / num_heads)"
            )
        self.d_model = d_model
        self.source_embedding = nn.Embedding(source_vocab_size, d_model, padding_idx=PAD_ID)
        self.target_embedding = nn.Embedding(target_vocab_size, d_model, padding_idx=PAD_ID)
        for embedding in (self.source_embedding, self.target_embedding):
            nn.init.normal_(embedding.weight, std=d_model**-0.5)  # scaled by sqrt(d) on use
        self.register_buffer("positions", sinusoidal_positions(DECODE_LIMIT + 512, d_model), persistent=False)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model, num_heads, ffn_dim, dropout, batch_first=True, norm_first=norm_first),
            num_layers,
            norm=nn.LayerNorm(d_model) if norm_first else None,
            enable_nested_tensor=False,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d_model, num_heads, ffn_dim, dropout, batch_first=True, norm_first=norm_first),
            num_layers,
            norm=nn.LayerNorm(d_model) if norm_first else None,
        )
        self.dropout = nn.Dropout(dropout)

    @property
    def output_size(self) -> int:
        return self.d_model

    def embed(self, embedding: nn.Embedding, tokens: Tensor) -> Tensor:
        T = tokens.size(1)
        if T > self.positions.size(0):
            raise ValueError(f"sentence of {T} pieces exceeds the {self.positions.size(0)} positions (lower data.init_args.max_train_length)")
        return self.dropout(embedding(tokens) * math.sqrt(self.d_model) + self.positions[:T])  # (B, T, d)

    def encode(self, source: Tensor, source_lengths: Tensor) -> dict[str, Tensor]:
        """Shape: ``source (B, S)`` -> ``memory (B, S, d)``, ``padding (B, S)``."""
        padding = source == PAD_ID
        memory = self.encoder(self.embed(self.source_embedding, source), src_key_padding_mask=padding)
        return {"memory": memory, "padding": padding}

    def decode(self, target_input: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Teacher-forced decoder. Shape: ``(B, T)`` -> ``(B, T, d)``."""
        T = target_input.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=target_input.device), diagonal=1)
        return self.decoder(
            self.embed(self.target_embedding, target_input),
            state["memory"],
            tgt_mask=causal,
            tgt_key_padding_mask=target_input == PAD_ID,
            memory_key_padding_mask=state["padding"],
        )

    def decode_step(self, tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One decoding step with per-layer key/value caches. ``tokens (N, t)`` -> ``(N, d)`` for position ``t - 1``.

        The searches call this with the prefix growing by one token per step (rows reordered or
        dropped through :func:`tasks.decoding.select_rows`, which also reorders the caches). Each
        layer keeps its self-attention's *projected* keys and values for every earlier position,
        and its cross-attention's projected encoder keys and values (computed at the first step),
        so a step runs every layer on the new token only and projects one key/value pair per
        layer: self-attention over the cache, cross-attention, feed-forward. Equals
        ``decode(tokens)[:, -1]`` to float rounding (tested); without a cache (or if the prefix is
        not the cache plus one token) it falls back to re-running the decoder on the whole prefix.
        Evaluation mode only.
        """
        cache = state.get("cache")
        t = tokens.size(1)
        if self.training or (cache is not None and cache["length"] != t - 1) or (cache is None and t != 1):
            return self.decode(tokens, state)[:, -1], state
        new = tokens[:, -1:]  # (N, 1)
        x = self.dropout(self.target_embedding(new) * math.sqrt(self.d_model) + self.positions[t - 1 : t])  # (N, 1, d)
        pad = new == PAD_ID  # (N, 1)
        keys_pad = pad if cache is None else torch.cat([cache["pad"], pad], 1)  # (N, t)
        self_kv, memory_kv = [], []
        for i, layer in enumerate(self.decoder.layers):
            first = layer.norm_first
            h = layer.norm1(x) if first else x  # (N, 1, d): query, key and value of self-attention
            q, k, v = _split_heads(nn.functional.linear(h, layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias), layer.self_attn.num_heads, 3)
            if cache is not None:
                k, v = torch.cat([cache["self"][i][0], k], 2), torch.cat([cache["self"][i][1], v], 2)  # (N, heads, t, hd)
            self_kv.append((k, v))
            attended = layer.dropout1(_cached_attention(layer.self_attn, q, k, v, keys_pad))
            x = x + attended if first else layer.norm1(x + attended)
            if cache is None:  # encoder keys/values: projected once per sentence
                attn = layer.multihead_attn
                d = self.d_model
                mem = nn.functional.linear(state["memory"], attn.in_proj_weight[d:], attn.in_proj_bias[d:])  # (N, S, 2d)
                memory_kv.append(_split_heads(mem, attn.num_heads, 2))
            else:
                memory_kv.append(cache["memory"][i])
            attn = layer.multihead_attn
            query = layer.norm2(x) if first else x
            q = _split_heads(nn.functional.linear(query, attn.in_proj_weight[: self.d_model], attn.in_proj_bias[: self.d_model]), attn.num_heads, 1)[0]
            crossed = layer.dropout2(_cached_attention(attn, q, *memory_kv[i], state["padding"]))
            x = x + crossed if first else layer.norm2(x + crossed)
            x = x + layer._ff_block(layer.norm3(x)) if first else layer.norm3(x + layer._ff_block(x))
        if self.decoder.norm is not None:
            x = self.decoder.norm(x)
        return x[:, 0], {**state, "cache": {"self": self_kv, "memory": memory_kv, "pad": keys_pad, "length": t}}


def _split_heads(projected: Tensor, num_heads: int, parts: int) -> tuple[Tensor, ...]:
    """``(N, T, parts * d)`` -> ``parts`` tensors ``(N, heads, T, d / heads)``."""
    N, T, _ = projected.shape
    return tuple(p.view(N, T, num_heads, -1).transpose(1, 2) for p in projected.chunk(parts, dim=-1))


def _cached_attention(attn: nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor, key_padding: Tensor) -> Tensor:
    """Scaled dot-product attention of projected ``q (N, h, 1, hd)`` over ``k, v (N, h, T, hd)``,
    padded keys (``key_padding (N, T)`` True) excluded, then ``attn``'s output projection: ``(N, 1, d)``."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (N, h, 1, T)
    scores = scores.masked_fill(key_padding[:, None, None, :], -math.inf)
    out = torch.softmax(scores, dim=-1) @ v  # (N, h, 1, hd)
    N, h, _, hd = out.shape
    return attn.out_proj(out.transpose(1, 2).reshape(N, 1, h * hd))
