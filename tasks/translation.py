"""Encoder-decoder translation with any output head, decoded by greedy or beam search.

Two architectures produce the decoder's hidden states; the head turns them into target-word
distributions, owns the loss and scores every decoding step (``head.topk``, see
:func:`tasks.decoding.head_candidates`):

* ``lstm``: LSTM encoder (optionally bidirectional) and LSTM decoder with Luong et al.
  (2015) global attention, *dot* score (§3.1, Eq. 7-8): ``a_t = softmax(h_t . h_s)``,
  ``c_t = sum_s a_ts h_s``, attentional state ``h~_t = tanh(W_c [c_t; h_t])`` (Eq. 5) fed to
  the head. Input feeding (§3.3) is left out so teacher-forced training runs the decoder
  LSTM over the whole sentence in one call, which matters on CPU.
* ``transformer``: Vaswani et al. (2017) encoder-decoder with sinusoidal positions (§3.5),
  embeddings scaled by ``sqrt(d_model)`` (§3.4), ``base`` / ``big`` presets (Table 3),
  label smoothing (§5.4) and the inverse-square-root warm-up (Eq. 3, :class:`InverseSquareRootLR`).

Metrics: validation loss/perplexity from summed token NLL; BLEU (sacrebleu, 13a) and chrF on
detokenised text, computed once on all ranks' gathered hypotheses, with sacrebleu's
signature printed and logged beside every score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.loggers import TensorBoardLogger
from sacrebleu.metrics import BLEU, CHRF
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from datamodules.bpe import TextTokenizer
from datamodules.translation import BOS_ID, EOS_ID, PAD_ID, UNK, check_tokenizer_state, decode_ids
from datamodules.vocab import Vocabulary
from tasks.base import IGNORE_INDEX, HeadSpec, HeadTask, build_head, global_mean_count
from tasks.decoding import (
    Hypothesis,
    beam_search,
    check_search_settings,
    greedy_search,
    head_candidates,
    max_lengths,
)

ARCHITECTURES = ("lstm", "transformer")
#: Vaswani et al. 2017, Table 3: (d_model, heads, d_ff, layers, dropout).
TRANSFORMER_PRESETS = {"base": (512, 8, 2048, 6, 0.1), "big": (1024, 16, 4096, 6, 0.3)}
DECODE_LIMIT = 512  # hard cap on generated length whatever max_len_a/b say


@dataclass
class DecodingSettings:
    """How test/predict/validation decode and where outputs go (see :class:`TranslationTask`)."""

    beam_size: int = 5
    length_penalty: float = 1.0
    max_len_a: float = 1.5
    max_len_b: int = 10
    nbest: int = 1
    early_stopping: bool = True
    val_beam_size: int = 1
    val_bleu_sentences: int = 500
    num_sample_translations: int = 3
    test_output: str | None = None
    predict_output: str | None = None


DECODING_SETTINGS = tuple(DecodingSettings.__dataclass_fields__)


class InverseSquareRootLR(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up to the optimizer's lr, then decay with ``1/sqrt(step)`` (Vaswani Eq. 3,
    normalised so the peak is the configured lr). Steps per batch."""

    step_per_batch = True

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 4000) -> None:
        if warmup_steps < 1:
            raise ValueError(f"InverseSquareRootLR needs warmup_steps >= 1, got {warmup_steps} (set lr_scheduler.init_args.warmup_steps)")
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        step = step + 1
        return min(step / self.warmup_steps, math.sqrt(self.warmup_steps / step))


# ------------------------------------------------------------------------------ LSTM
class LuongAttentionSeq2Seq(nn.Module):
    """LSTM encoder + LSTM decoder with global dot-product attention (Luong et al. 2015)."""

    def __init__(self, source_vocab_size: int, target_vocab_size: int, embed_dim: int, hidden_size: int, num_layers: int, bidirectional: bool, dropout: float,
                 attentional_layer: bool = True) -> None:
        super().__init__()
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.attentional_layer = attentional_layer
        self.bidirectional = bidirectional
        self.source_embedding = nn.Embedding(source_vocab_size, embed_dim, padding_idx=PAD_ID)
        self.target_embedding = nn.Embedding(target_vocab_size, embed_dim, padding_idx=PAD_ID)
        layer_dropout = dropout if num_layers > 1 else 0.0
        self.encoder = nn.LSTM(embed_dim, hidden_size, num_layers, batch_first=True, dropout=layer_dropout, bidirectional=bidirectional)
        self.decoder = nn.LSTM(embed_dim, hidden_size, num_layers, batch_first=True, dropout=layer_dropout)
        if bidirectional:
            # Dot attention needs keys of the decoder's width: project [forward; backward].
            self.memory_projection = nn.Linear(2 * hidden_size, hidden_size, bias=False)
            self.bridge_h = nn.Linear(2 * hidden_size, hidden_size)
            self.bridge_c = nn.Linear(2 * hidden_size, hidden_size)
        if attentional_layer:
            self.attentional = nn.Linear(2 * hidden_size, hidden_size, bias=False)  # W_c, Eq. 5
        self.dropout = nn.Dropout(dropout)

    @property
    def output_size(self) -> int:
        return self.hidden_size if self.attentional_layer else 2 * self.hidden_size

    def encode(self, source: Tensor, source_lengths: Tensor) -> dict[str, Tensor]:
        """Shape: ``source (B, S)``, ``source_lengths (B,)`` -> state with batch-first tensors."""
        B, S = source.shape
        embedded = self.dropout(self.source_embedding(source))  # (B, S, E)
        packed = pack_padded_sequence(embedded, source_lengths.cpu(), batch_first=True, enforce_sorted=False)
        outputs, (h, c) = self.encoder(packed)
        memory, _ = pad_packed_sequence(outputs, batch_first=True, total_length=S)  # (B, S, dirs*H)
        if self.bidirectional:
            memory = self.memory_projection(memory)  # (B, S, H)
            h = h.view(self.num_layers, 2, B, self.hidden_size)  # (L, dirs, B, H)
            c = c.view(self.num_layers, 2, B, self.hidden_size)
            h = torch.tanh(self.bridge_h(torch.cat([h[:, 0], h[:, 1]], dim=-1)))  # (L, B, H)
            c = self.bridge_c(torch.cat([c[:, 0], c[:, 1]], dim=-1))  # (L, B, H)
        return {
            "memory": memory,
            "padding": source == PAD_ID,  # (B, S) True where padded
            "h": h.transpose(0, 1).contiguous(),  # (B, L, H): rows first for beam reordering
            "c": c.transpose(0, 1).contiguous(),
        }

    def attend(self, decoder_states: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Attentional hidden states ``h~ = tanh(W_c [c; h])``, or ``[c; h]`` itself without the
        attentional layer. Shape: ``(B, T, H) -> (B, T, output_size)``."""
        scores = decoder_states @ state["memory"].transpose(1, 2)  # (B, T, S), dot score Eq. 8
        scores = scores.masked_fill(state["padding"].unsqueeze(1), -math.inf)
        weights = torch.softmax(scores, dim=-1)
        context = weights @ state["memory"]  # (B, T, H), Eq. 7 weighted average
        combined = torch.cat([context, decoder_states], dim=-1)  # (B, T, 2H)
        if not self.attentional_layer:
            return self.dropout(combined)
        return self.dropout(torch.tanh(self.attentional(combined)))

    def decode(self, target_input: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Teacher-forced decoder. Shape: ``target_input (B, T)`` -> hidden ``(B, T, H)``."""
        embedded = self.dropout(self.target_embedding(target_input))  # (B, T, E)
        initial = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())  # (L, B, H)
        outputs, _ = self.decoder(embedded, initial)  # (B, T, H)
        return self.attend(outputs, state)

    def decode_step(self, tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One step from the last token. Shape: ``tokens (N, t)`` -> hidden ``(N, H)``."""
        embedded = self.target_embedding(tokens[:, -1:])  # (N, 1, E)
        initial = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())
        output, (h, c) = self.decoder(embedded, initial)  # (N, 1, H)
        hidden = self.attend(output, state)[:, 0]  # (N, H)
        return hidden, {**state, "h": h.transpose(0, 1), "c": c.transpose(0, 1)}


# ------------------------------------------------------------------------------ Transformer
def sinusoidal_positions(length: int, width: int) -> Tensor:
    """Vaswani §3.5: ``PE(pos, 2i) = sin(pos / 10000^(2i/d))``, cos on odd dims. ``(length, width)``."""
    position = torch.arange(length, dtype=torch.float).unsqueeze(1)  # (T, 1)
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: width // 2])
    return table


class TransformerSeq2Seq(nn.Module):
    """Transformer encoder-decoder; the decoder's last-layer states go to the head."""

    def __init__(self, source_vocab_size: int, target_vocab_size: int, d_model: int, num_heads: int, ffn_dim: int, num_layers: int, dropout: float, norm_first: bool = True) -> None:
        super().__init__()
        if d_model % num_heads or d_model % 2:
            raise ValueError(f"transformer needs an even d_model divisible by num_heads, got d_model={d_model}, num_heads={num_heads} (set model.init_args.embed_dim / num_heads)")
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


# ------------------------------------------------------------------------------ task
class TranslationTask(HeadTask):
    """Sequence-to-sequence translation; the output layer is any head.

    Args:
        num_classes: target vocabulary size (linked from ``data.num_classes``).
        source_vocab_size: source vocabulary size (from ``data.source_vocab_size``).
        head: output layer (short name or class_path + init_args).
        architecture: ``lstm`` (Luong attention) or ``transformer``.
        preset: transformer size ``base`` or ``big`` (overrides embed_dim, num_heads,
            ffn_dim, num_layers, dropout).
        embed_dim: embedding width (``d_model`` for the transformer).
        hidden_size: LSTM width.
        num_layers: encoder and decoder layers.
        bidirectional: bidirectional LSTM encoder.
        attentional_layer: LSTM only. ``True`` (Luong): the head gets ``tanh(W_c [c_t; h_t])``.
            ``False``: the head gets ``[c_t; h_t]`` (width ``2 hidden_size``) and its own
            projection plays the attentional layer's part, so MoS's / Mixtape's ``tanh(W_k g)``
            contexts are ``K`` attentional vectors instead of a second ``tanh`` layer stacked on
            the first (MoS-1 is then exactly the Luong softmax model, plus a bias). Set the
            head's ``embedding_dim`` to keep its class embeddings at the decoder width.
        num_heads / ffn_dim: transformer attention heads / feed-forward width.
        dropout: dropout on embeddings, between layers and on attentional states.
        tie_weights: share the decoder's input embedding with the head's class embeddings.
        unigram_bias_init: start the head's class biases at the training targets' unigram (log
            frequencies, EOS included) when fitting from scratch. Heads behind ``tanh`` latent
            layers (MoS, MoC) otherwise spend their first epochs learning it: on Multi30k
            De-En, MoS-9 reached validation BLEU 4.6 after 4 epochs where Softmax had 18.5
            (docs/translation.md).
        label_smoothing: epsilon of label smoothing (needs the head's full ``log_prob``).
        beam_size / length_penalty / max_len_a / max_len_b / nbest / early_stopping: test
            and predict decoding (see :mod:`tasks.decoding`).
        val_beam_size: beam used for validation BLEU (1 = greedy).
        val_bleu_sentences: validation sentences (the first ones) decoded for BLEU each
            epoch; 0 disables, -1 decodes all.
        num_sample_translations: validation samples written to TensorBoard as text.
        test_output / predict_output: files receiving detokenised hypotheses, one line per
            source line, in input order.
    """

    #: on_load_checkpoint gives the datamodule the checkpoint's tokenizers and vocabularies.
    adopts_checkpoint_vocabulary = True

    def __init__(
        self,
        num_classes: int,
        source_vocab_size: int,
        head: HeadSpec = "softmax",
        architecture: str = "lstm",
        preset: str | None = None,
        embed_dim: int = 256,
        hidden_size: int = 256,
        num_layers: int = 2,
        bidirectional: bool = True,
        attentional_layer: bool = True,
        num_heads: int = 4,
        ffn_dim: int = 1024,
        dropout: float = 0.2,
        tie_weights: bool = False,
        unigram_bias_init: bool = True,
        label_smoothing: float = 0.0,
        beam_size: int = 5,
        length_penalty: float = 1.0,
        max_len_a: float = 1.5,
        max_len_b: int = 10,
        nbest: int = 1,
        early_stopping: bool = True,
        val_beam_size: int = 1,
        val_bleu_sentences: int = 500,
        num_sample_translations: int = 3,
        test_output: str | None = None,
        predict_output: str | None = None,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: LRSchedulerCallable | None = None,
        monitor: str = "val/loss",
    ) -> None:
        super().__init__(optimizer=optimizer, lr_scheduler=lr_scheduler, monitor=monitor)
        # Decoding and output settings are run-time choices, not part of the trained model: kept
        # out of the saved hyper-parameters so a checkpoint never overrides the command line
        # (LightningCLI re-applies a checkpoint's hyper-parameters on --ckpt_path).
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", *DECODING_SETTINGS])
        self.decoding = DecodingSettings(
            beam_size, length_penalty, max_len_a, max_len_b, nbest, early_stopping, val_beam_size,
            val_bleu_sentences, num_sample_translations, test_output, predict_output,
        )
        if architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {architecture!r}: valid are {', '.join(ARCHITECTURES)} (set model.init_args.architecture)")
        if preset is not None and (architecture != "transformer" or preset not in TRANSFORMER_PRESETS):
            raise ValueError(f"preset {preset!r} needs architecture transformer and one of {', '.join(TRANSFORMER_PRESETS)} (set model.init_args.preset)")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"TranslationTask needs label_smoothing in [0, 1), got {label_smoothing} (set model.init_args.label_smoothing)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"TranslationTask needs dropout in [0, 1), got {dropout} (set model.init_args.dropout)")
        for key, value in (("num_classes", num_classes), ("source_vocab_size", source_vocab_size)):
            if value < 5:
                raise ValueError(f"TranslationTask needs {key} >= 5 (4 specials + a word), got {value} (link it from the datamodule)")
        check_search_settings(beam_size, nbest, max_len_a, max_len_b)
        check_search_settings(val_beam_size, 1, max_len_a, max_len_b)
        if architecture == "lstm":
            self.model: nn.Module = LuongAttentionSeq2Seq(source_vocab_size, num_classes, embed_dim, hidden_size, num_layers, bidirectional, dropout,
                                                          attentional_layer)
        else:
            if not attentional_layer:
                raise ValueError("attentional_layer: false applies to architecture lstm only, got architecture transformer (remove model.init_args.attentional_layer)")
            if preset is not None:
                embed_dim, num_heads, ffn_dim, num_layers, dropout = TRANSFORMER_PRESETS[preset]
            self.model = TransformerSeq2Seq(source_vocab_size, num_classes, embed_dim, num_heads, ffn_dim, num_layers, dropout)
        self.head = build_head(head, self.model.output_size, num_classes)
        self.unigram_bias_init = unigram_bias_init
        if tie_weights:
            self.head.tie_to(self.model.target_embedding)
        self._checkpoint_decoder: tuple[Vocabulary, TextTokenizer] | None = None
        self._reset_eval_state()

    # ------------------------------------------------------------------ model
    def forward(self, source: Tensor, source_lengths: Tensor, target_input: Tensor) -> Tensor:
        """Decoder hidden states under teacher forcing.

        Shape:
            source ``(B, S)``, source_lengths ``(B,)``, target_input ``(B, T)`` -> ``(B, T, d)``.
        """
        return self.model.decode(target_input, self.model.encode(source, source_lengths))

    def token_nll(self, batch: dict[str, Any]) -> Tensor:
        """Per-token NLL ``(B, T)``, zero at padding."""
        hidden = self(batch["source"], batch["source_lengths"], batch["target_input"])
        return self.head(hidden, batch["target_output"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        target = batch["target_output"]
        tokens = (target != IGNORE_INDEX).sum().clamp(min=1)
        divisor = global_mean_count(tokens)
        epsilon = self.hparams.label_smoothing
        if epsilon > 0:
            # Label smoothing (Szegedy et al. 2016; Vaswani §5.4): mix the NLL with the
            # cross-entropy to the uniform distribution, which needs all log-probabilities.
            hidden = self(batch["source"], batch["source_lengths"], batch["target_input"])
            log_probs = self.head.log_prob(hidden)  # (B, T, V)
            valid = target != IGNORE_INDEX
            nll = -log_probs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
            uniform = -log_probs.mean(dim=-1)  # (B, T)
            loss = (((1 - epsilon) * nll + epsilon * uniform) * valid).sum() / divisor
            nll_sum = (nll * valid).sum()
        else:
            nll_sum = self.token_nll(batch).sum()
            loss = nll_sum / divisor
        # Averaged over ranks, each rank's loss is the global per-token mean (see global_mean_count).
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=int(tokens), sync_dist=True)
        self.log("train/ppl", torch.exp(nll_sum.detach() / tokens), batch_size=int(tokens))  # this rank's sentences
        self.log_head_stats("train")
        loss = self.add_head_regularization(loss, "train")
        return loss

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def translate(self, source: Tensor, source_lengths: Tensor, beam_size: int | None = None, nbest: int = 1) -> list[list[Hypothesis]]:
        """Decode a batch; ``nbest`` hypotheses per sentence (beam 1 runs greedy search); both
        searches score a step by the head's ``topk`` (see :func:`tasks.decoding.head_candidates`).

        Shape: ``source (B, S)``, ``source_lengths (B,)`` (EOS included).
        """
        hp = self.decoding
        beam_size = hp.beam_size if beam_size is None else beam_size
        state = self.model.encode(source, source_lengths)
        budget = max_lengths(source_lengths - 1, hp.max_len_a, hp.max_len_b, DECODE_LIMIT)  # (B,)

        greedy = beam_size == 1 and nbest == 1
        width = 1 if greedy else 2 * beam_size  # tokens per row a search can select (decoding.py)

        def step(tokens: Tensor, state: Any) -> tuple[Tensor, Any]:
            hidden, state = self.model.decode_step(tokens, state)  # (N, d)
            return head_candidates(self.head, hidden, width), state  # the head's top `width` tokens per row

        B = source.size(0)
        if greedy:
            return [[h] for h in greedy_search(step, state, B, BOS_ID, EOS_ID, budget, source.device)]
        return beam_search(step, state, B, BOS_ID, EOS_ID, budget, beam_size, hp.length_penalty, nbest, hp.early_stopping, source.device)

    def decode_text(self, ids: list[int]) -> str:
        """Detokenise generated ids with the data's (or the checkpoint's) tokenizer."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "decode_target"):
            return datamodule.decode_target(ids)
        if self._checkpoint_decoder is None:
            raise ValueError("no tokenizer to detokenise with: attach a TranslationDataModule or load a checkpoint that stores one")
        vocab, tokenizer = self._checkpoint_decoder
        return decode_ids(ids, vocab, tokenizer)

    # ------------------------------------------------------------------ evaluation
    def _reset_eval_state(self) -> None:
        self._nll_sum = torch.zeros(())
        self._token_count = torch.zeros(())
        self._outputs: list[tuple[int, str, str | None, str]] = []  # (line, hypothesis, reference, source)

    def on_validation_epoch_start(self) -> None:
        self._reset_eval_state()

    on_test_epoch_start = on_validation_epoch_start
    on_predict_epoch_start = on_validation_epoch_start

    def _evaluate(self, batch: dict[str, Any], beam_size: int, sentences: int) -> None:
        if batch.get("filler"):
            return  # keeps DDP ranks in step; its sentence is scored by another rank
        nll = self.token_nll(batch)
        self._nll_sum = self._nll_sum + nll.sum().detach().cpu().double()
        self._token_count = self._token_count + (batch["target_output"] != IGNORE_INDEX).sum().cpu().double()
        chosen = [row for row, line in enumerate(batch["index"].tolist()) if sentences < 0 or line < sentences]
        if not chosen:
            return
        rows = torch.tensor(chosen, device=batch["source"].device)
        hypotheses = self.translate(batch["source"][rows], batch["source_lengths"][rows], beam_size)
        for row, hyps in zip(chosen, hypotheses):
            text = self.decode_text(hyps[0].tokens)
            self._outputs.append((int(batch["index"][row]), text, batch["reference"][row], batch["source_text"][row]))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.decoding.val_beam_size, self.decoding.val_bleu_sentences)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.decoding.beam_size, -1)

    def _gather(self, items: list) -> list:
        """All ranks' items (every rank scored a disjoint share), sorted by line."""
        if self.trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            parts: list[list] = [None] * self.trainer.world_size  # type: ignore[list-item]
            torch.distributed.all_gather_object(parts, items)
            items = [item for part in parts for item in part]
        return sorted(items, key=lambda item: item[0])

    def _finish_evaluation(self, stage: str) -> dict[str, float]:
        nll_sum = self.trainer.strategy.reduce(self._nll_sum.to(self.device), reduce_op="sum")
        tokens = self.trainer.strategy.reduce(self._token_count.to(self.device), reduce_op="sum")
        loss = float(nll_sum / tokens.clamp(min=1))
        self.log(f"{stage}/loss", loss)
        self.log(f"{stage}/ppl", math.exp(min(loss, 50.0)))
        self.log(f"{stage}/tokens", float(tokens))  # summed over ranks: each target token once
        outputs = self._gather(self._outputs)
        scores = {"loss": loss}
        if not outputs:
            return scores
        self.log(f"{stage}/sentences", float(len(outputs)))  # decoded sentences, all ranks
        hypotheses = [o[1] for o in outputs]
        references = [o[2] for o in outputs]
        bleu, chrf = BLEU(), CHRF()  # 13a tokenizer, exponential smoothing: sacrebleu defaults
        bleu_score = bleu.corpus_score(hypotheses, [references])
        chrf_score = chrf.corpus_score(hypotheses, [references])
        self.log(f"{stage}/bleu", bleu_score.score)
        self.log(f"{stage}/chrf", chrf_score.score)
        scores.update(bleu=bleu_score.score, chrf=chrf_score.score)
        if stage == "val":
            self.log_hp_metric(bleu_score.score)  # TensorBoard HPARAMS: the headline score
        self.last_signatures = {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())}
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            print(f"{stage} epoch {self.current_epoch}: {bleu_score} ({len(outputs)} sentences) | signature {bleu.get_signature()}")
            print(f"{stage} epoch {self.current_epoch}: {chrf_score} | signature {chrf.get_signature()}")
            self._write_text_logs(stage, outputs, bleu_score, bleu.get_signature())
        return scores

    def _write_text_logs(self, stage: str, outputs: list, bleu_score: Any, signature: Any) -> None:
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                writer = logger.experiment
                writer.add_text(f"{stage}/bleu_signature", f"{bleu_score} `{signature}`", self.global_step)
                samples = outputs[: self.decoding.num_sample_translations]
                table = "\n\n".join(f"**source:** {s}  \n**reference:** {r}  \n**hypothesis:** {h}" for _, h, r, s in samples)
                if table:
                    writer.add_text(f"{stage}/samples", table, self.global_step)

    def on_validation_epoch_end(self) -> None:
        self._finish_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._finish_evaluation("test")
        if self.decoding.test_output:
            outputs = self._gather(self._outputs)  # a collective: every rank joins
            if self.trainer.is_global_zero:
                write_lines(self.decoding.test_output, [o[1] for o in outputs])

    # ------------------------------------------------------------------ predict
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[tuple[int, str]]:
        if batch.get("filler"):
            return []
        hp = self.decoding
        hypotheses = self.translate(batch["source"], batch["source_lengths"], hp.beam_size, hp.nbest)
        results = []
        for line, hyps in zip(batch["index"].tolist(), hypotheses):
            texts = [self.decode_text(h.tokens) for h in hyps]
            self._outputs.append((line, texts[0], None, " ||| ".join(f"{t} ||| {h.score:.4f}" for t, h in zip(texts, hyps))))
            results.append((line, texts[0]))
        return results

    def on_predict_epoch_end(self) -> None:
        outputs = self._gather(self._outputs)
        if self.decoding.predict_output and self.trainer.is_global_zero:
            write_lines(self.decoding.predict_output, [o[1] for o in outputs])
            if self.decoding.nbest > 1:
                write_lines(self.decoding.predict_output + ".nbest", [f"{o[0]} ||| {o[3]}" for o in outputs])

    # ------------------------------------------------------------------ checkpoints
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("hyper_parameters", {}).get("source_vocab_size")
        if saved is not None and int(saved) != int(self.hparams.source_vocab_size):
            raise ValueError(
                f"checkpoint was trained with a source vocabulary of {saved} but the data gives "
                f"{self.hparams.source_vocab_size}: use the data and tokenizer settings it was trained with"
            )
        state = checkpoint.get("datamodule_state")
        check_tokenizer_state(state)
        self._checkpoint_decoder = (
            Vocabulary.from_itos(state["target_itos"], unk=UNK),
            TextTokenizer.from_state(state["target_tokenizer"]),
        )
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "load_state_for_checkpoint"):
            datamodule.load_state_for_checkpoint(state)  # encode inputs exactly as in training


def write_lines(path: str, lines: list[str]) -> None:
    """Write one hypothesis per line (newlines inside a hypothesis would break alignment)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line.replace("\n", " ") + "\n")
