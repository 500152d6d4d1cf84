"""Image captioning: a torchvision ResNet encoder and an LSTM decoder; any head as output layer.

The model is Show and Tell (NIC; Vinyals et al. 2015, §3.1): the image embedding
``x_{-1} = W_I CNN(I)`` is the LSTM's *first input* and only sets its state; words follow
as ``x_t = W_e S_t`` from the start token on, and the LSTM output at step ``t`` predicts
``S_{t+1}`` through the head (Eq. 10-12). With ``attention: true`` the decoder also attends
over the CNN's spatial grid at every step (Show, Attend and Tell; Xu et al. 2015, §3.1.2):
additive scores ``e_ti = w^T tanh(W_a a_i + W_h h_{t-1})`` (Eq. 4-5, "soft" attention), the
context ``z_t = sum_i alpha_ti a_i`` (Eq. 13) joins the word embedding as LSTM input, and
the head reads the deep output ``E y_{t-1} + L_h h_t + L_z z_t`` (Eq. 7).

Decoding is :mod:`tasks.decoding` (greedy and beam search, shared with translation): the
step function embeds the last token, runs one LSTM step and returns the head's top tokens
(``tasks.decoding.head_candidates``).

Metrics: ``val/loss`` (token NLL over every reference caption, what checkpointing monitors)
and ``val/ppl`` each epoch; COCO metrics (:mod:`tasks.caption_metrics`) on the first
``val_caption_images`` validation images decoded with ``val_beam_size``, and on the whole
test split with ``beam_size``. Captions of all ranks are gathered and scored once.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
from typing import Any

import torch
import torchvision
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from datamodules.bpe import TextTokenizer
from datamodules.bpe import decode_ids
from datamodules.captioning import BOS_ID, EOS_ID, PAD_ID, UNK
from datamodules.vocab import Vocabulary
from tasks.base import IGNORE_INDEX, HeadSpec, HeadTask, build_head, global_mean_count
from tasks.caption_metrics import CaptionScorer
from tasks.decoding import Hypothesis, beam_search, check_search_settings, greedy_search, head_candidates
from datamodules.files import write_atomically

ENCODERS = ("resnet18", "resnet50", "resnet101")
EVALUATION_SETTINGS = (
    "beam_size", "length_penalty", "max_caption_length", "val_beam_size", "val_caption_images", "num_sample_captions",
    "metric_tokenizer", "meteor", "val_meteor", "spice", "test_output", "predict_output",
)


# ------------------------------------------------------------------------------ encoder
def build_resnet(arch: str, weights: str | None) -> nn.Module:
    """A torchvision ResNet, with ImageNet ``weights`` (an enum name such as ``DEFAULT`` or
    ``IMAGENET1K_V1``) when they can be loaded (local torch hub cache or download), random
    initialisation otherwise. Prints one notice line either way."""
    if arch not in ENCODERS:
        raise ValueError(f"unknown encoder {arch!r}: valid are {', '.join(ENCODERS)} (set model.init_args.encoder)")
    network = torchvision.models.get_model(arch, weights=None)
    if weights is None:
        rank_zero_info(f"{arch}: random initialisation (model.init_args.weights is null)")
        return network
    available = torchvision.models.get_model_weights(arch)
    try:
        weight_enum = available[weights] if weights != "DEFAULT" else available.DEFAULT
    except KeyError:
        names = ", ".join(["DEFAULT"] + [w.name for w in available])
        raise ValueError(f"unknown weights {weights!r} for {arch}: valid are {names}, or null for random init (set model.init_args.weights)") from None
    try:
        # torch.hub reports its download on stderr; the one notice below says what happened.
        with contextlib.redirect_stderr(io.StringIO()):
            state = weight_enum.get_state_dict(progress=False, check_hash=False)
        network.load_state_dict(state)
    except Exception as error:  # no network, a corrupt cache file, ...: all mean "train from scratch"
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        rank_zero_warn(f"{arch}: could not load {weight_enum} ({type(error).__name__}: {reason}); using random initialisation")
        return network
    rank_zero_info(f"{arch}: loaded ImageNet weights {weight_enum}")
    return network


class ResNetEncoder(nn.Module):
    """The convolutional trunk of a ResNet (classifier and global pool removed).

    Args:
        arch: ``resnet18``, ``resnet50`` or ``resnet101``.
        weights: torchvision weights name, or ``None`` for random initialisation.
        trainable: fine-tune the trunk; when ``False`` its parameters are frozen and its
            batch-norm statistics stay fixed (eval mode) during training.
    """

    def __init__(self, arch: str = "resnet18", weights: str | None = None, trainable: bool = True) -> None:
        super().__init__()
        network = build_resnet(arch, weights)
        self.trunk = nn.Sequential(
            network.conv1, network.bn1, network.relu, network.maxpool,
            network.layer1, network.layer2, network.layer3, network.layer4,
        )
        self.out_channels: int = network.fc.in_features
        self.trainable = trainable
        if not trainable:
            self.trunk.requires_grad_(False)
            # Lightning 2 does not call .train() on the model when fitting starts: a frozen trunk
            # must *start* in eval mode, or its batch norm keeps updating its running statistics
            # (and normalises with each batch's own, which differs between DDP ranks).
            self.trunk.eval()

    def train(self, mode: bool = True) -> "ResNetEncoder":
        super().train(mode and self.trainable)
        return self

    def forward(self, images: Tensor) -> Tensor:
        """Annotation vectors on the spatial grid.

        Shape:
            images ``(B, 3, H, W)`` -> ``(B, P, C)`` with ``P = ceil(H/32) * ceil(W/32)``.
        """
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            grid = self.trunk(images)  # (B, C, h, w)
        return grid.flatten(2).transpose(1, 2)  # (B, h*w, C)


class FeatureCache:
    """Annotation vectors of a *frozen* encoder on disk, one float16 file per image id, so
    later epochs skip the CNN (the decoder then trains at its own speed).

    Files live in ``root/<arch>-<digest of the encoder's weights>-<H>x<W>/<image_id>.pt``:
    a different encoder, different weights (another random init, another ImageNet file) or
    another image size never reads stale features.
    """

    def __init__(self, root: str, arch: str) -> None:
        self.root, self.arch = root, arch
        self._weights_digest: str | None = None

    def directory(self, encoder: nn.Module, images: Tensor) -> str:
        if self._weights_digest is None:
            digest = hashlib.sha256()
            for name, tensor in sorted(encoder.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            self._weights_digest = digest.hexdigest()[:16]
        H, W = images.shape[-2:]
        return os.path.join(self.root, f"{self.arch}-{self._weights_digest}-{H}x{W}")

    def __call__(self, encoder: nn.Module, images: Tensor, image_ids: Tensor) -> Tensor:
        """Shape: images ``(B, 3, H, W)``, image_ids ``(B,)`` -> ``(B, P, C)``."""
        directory = self.directory(encoder, images)
        paths = [os.path.join(directory, f"{int(i)}.pt") for i in image_ids.tolist()]
        if all(os.path.exists(path) for path in paths):
            return torch.stack([torch.load(path, weights_only=True) for path in paths]).to(images.device).float()
        with torch.no_grad():
            annotations = encoder(images)  # (B, P, C)
        os.makedirs(directory, exist_ok=True)
        for path, features in zip(paths, annotations.half().cpu()):
            partial = f"{path}.{os.getpid()}.tmp"
            torch.save(features.clone(), partial)
            os.replace(partial, path)  # atomic: DDP ranks and data workers never read half a file
        return annotations.half().float()  # the precision later epochs will read back


# ------------------------------------------------------------------------------ decoder
class SoftAttention(nn.Module):
    """Additive attention over annotation vectors (Xu et al. 2015, Eq. 4-5 and 13)."""

    def __init__(self, feature_dim: int, hidden_size: int, attention_dim: int) -> None:
        super().__init__()
        self.feature_projection = nn.Linear(feature_dim, attention_dim)  # W_a
        self.hidden_projection = nn.Linear(hidden_size, attention_dim, bias=False)  # W_h
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w

    def forward(self, annotations: Tensor, projected: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Context vector and weights.

        Shape:
            annotations ``(N, P, C)``, projected ``(N, P, A)`` (= ``W_a a``, cached per
            image), hidden ``(N, H)`` -> context ``(N, C)``, weights ``(N, P)``.
        """
        scores = self.score(torch.tanh(projected + self.hidden_projection(hidden).unsqueeze(1))).squeeze(-1)  # (N, P)
        weights = torch.softmax(scores, dim=-1)
        context = (weights.unsqueeze(-1) * annotations).sum(dim=1)  # (N, C), Eq. 13
        return context, weights


class ShowTellDecoder(nn.Module):
    """NIC's LSTM decoder, optionally with soft attention; produces the head's input.

    Args:
        num_classes: vocabulary size (word embeddings ``W_e``).
        feature_dim: channels ``C`` of the annotation vectors.
        embed_dim: word and image embedding width.
        hidden_size: LSTM width.
        num_layers: stacked LSTM layers.
        dropout: on embeddings, between LSTM layers and on the head's input.
        attention: add soft attention (Xu et al.) to NIC.
        attention_dim: width ``A`` of the attention MLP.
    """

    def __init__(self, num_classes: int, feature_dim: int, embed_dim: int, hidden_size: int, num_layers: int, dropout: float, attention: bool, attention_dim: int) -> None:
        super().__init__()
        self.attention = SoftAttention(feature_dim, hidden_size, attention_dim) if attention else None
        self.image_embedding = nn.Linear(feature_dim, embed_dim)  # W_I, NIC Eq. 10
        self.word_embedding = nn.Embedding(num_classes, embed_dim, padding_idx=PAD_ID)  # W_e, Eq. 11
        input_size = embed_dim + (feature_dim if attention else 0)
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True, dropout=dropout if num_layers > 1 else 0.0)
        if attention:
            self.output_hidden = nn.Linear(hidden_size, embed_dim)  # L_h, Xu Eq. 7
            self.output_context = nn.Linear(feature_dim, embed_dim, bias=False)  # L_z
        self.dropout = nn.Dropout(dropout)
        self.output_size = embed_dim if attention else hidden_size

    def start(self, annotations: Tensor) -> dict[str, Tensor]:
        """Feed the image embedding as the first input (NIC Eq. 10); its output is unused.

        Shape: annotations ``(N, P, C)`` -> state of batch-first tensors with ``N`` rows.
        """
        pooled = annotations.mean(dim=1)  # (N, C): the CNN's global-pool feature
        image = self.dropout(self.image_embedding(pooled)).unsqueeze(1)  # (N, 1, E)
        if self.attention is not None:
            # There is no h_{-1} to attend with yet: the image step reads the mean annotation,
            # which Xu et al. (§3.1.2) also use to initialise the LSTM.
            image = torch.cat([image, pooled.unsqueeze(1)], dim=-1)  # (N, 1, E + C)
        _, (h, c) = self.lstm(image)  # (L, N, H)
        state = {"h": h.transpose(0, 1).contiguous(), "c": c.transpose(0, 1).contiguous()}  # (N, L, H)
        if self.attention is not None:
            state["annotations"] = annotations
            state["projected"] = self.attention.feature_projection(annotations)  # (N, P, A)
        return state

    def step(self, tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One decoding step from the previous word.

        Shape: tokens ``(N,)`` -> head input ``(N, output_size)`` and the next state.
        """
        word = self.dropout(self.word_embedding(tokens))  # (N, E)
        h0, c0 = state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous()  # (L, N, H)
        context = None
        if self.attention is not None:
            context, _ = self.attention(state["annotations"], state["projected"], h0[-1])  # (N, C)
            lstm_input = torch.cat([word, context], dim=-1)  # (N, E + C)
        else:
            lstm_input = word
        output, (h, c) = self.lstm(lstm_input.unsqueeze(1), (h0, c0))  # (N, 1, H)
        hidden = self.output(output[:, 0], word, context)  # (N, D)
        return hidden, {**state, "h": h.transpose(0, 1), "c": c.transpose(0, 1)}

    def output(self, lstm_output: Tensor, word: Tensor, context: Tensor | None) -> Tensor:
        """The head's input: the LSTM output (NIC) or Xu's deep output (Eq. 7)."""
        if self.attention is None:
            return self.dropout(lstm_output)
        return self.dropout(word + self.output_hidden(lstm_output) + self.output_context(context))

    def forward(self, annotations: Tensor, caption_input: Tensor) -> Tensor:
        """Teacher-forced hidden states.

        Shape:
            annotations ``(N, P, C)`` (one row per caption), caption_input ``(N, T)``
            ``[BOS, w_1 .. w_n]`` -> ``(N, T, output_size)``.
        """
        state = self.start(annotations)
        if self.attention is None:
            # Without attention every input is known up front: one cuDNN/MKL LSTM call.
            words = self.dropout(self.word_embedding(caption_input))  # (N, T, E)
            h0, c0 = state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous()
            outputs, _ = self.lstm(words, (h0, c0))  # (N, T, H)
            return self.dropout(outputs)
        hidden = []
        for t in range(caption_input.size(1)):  # attention needs h_{t-1} before step t's input
            step_hidden, state = self.step(caption_input[:, t], state)
            hidden.append(step_hidden)
        return torch.stack(hidden, dim=1)  # (N, T, D)


# ------------------------------------------------------------------------------ task
class CaptioningTask(HeadTask):
    """Image captioning (NIC, optionally with soft attention); the output layer is any head.

    Args:
        num_classes: caption vocabulary size (linked from ``data.num_classes``).
        head: output layer (short name or class_path + init_args).
        encoder: ``resnet18``, ``resnet50`` or ``resnet101``.
        weights: torchvision ImageNet weights name (``DEFAULT``, ``IMAGENET1K_V1``, ...) or
            null; unloadable weights fall back to random init with a one-line notice.
        freeze_encoder: keep the CNN fixed (parameters and batch-norm statistics).
        feature_cache: directory caching the frozen CNN's features per image id (needs
            ``freeze_encoder: true``; see :class:`FeatureCache`).
        embed_dim / hidden_size / num_layers: word/image embedding width, LSTM width and depth.
        dropout: decoder dropout.
        unigram_bias_init: start the head's class biases at the training captions' unigram
            (pieces plus one EOS per caption) when fitting from scratch, as the language-model
            and translation tasks do by default; off by default here only because the figures
            in docs/captioning.md were measured without it (the COCO preset turns it on).
        attention / attention_dim: soft attention over the spatial grid and its MLP width.
        beam_size / length_penalty: test and predict decoding (``length_penalty`` is the
            exponent of the length normaliser, 0 = plain sum of log-probabilities).
        max_caption_length: generated tokens per caption at most (EOS included).
        val_beam_size: decoding for validation metrics (1 = greedy).
        val_caption_images: validation images (the first ones) captioned for COCO metrics
            each epoch; 0 disables, -1 captions all.
        num_sample_captions: captions written to TensorBoard as text per evaluation.
        metric_tokenizer / meteor / spice: see :class:`tasks.caption_metrics.CaptionScorer`.
        val_meteor: also compute METEOR at validation (its JVM start-up and paraphrase
            table cost about ten seconds per evaluation; test always includes it).
        test_output / predict_output: COCO results JSON files (``[{"image_id", "caption"}]``);
            ``predict_output`` defaults to ``<default_root_dir>/captions.json``.
    """

    def __init__(
        self,
        num_classes: int,
        head: HeadSpec = "softmax",
        encoder: str = "resnet18",
        weights: str | None = None,
        freeze_encoder: bool = False,
        feature_cache: str | None = None,
        embed_dim: int = 512,
        hidden_size: int = 512,
        num_layers: int = 1,
        dropout: float = 0.5,
        unigram_bias_init: bool = False,
        attention: bool = False,
        attention_dim: int = 512,
        beam_size: int = 3,
        length_penalty: float = 0.0,
        max_caption_length: int = 20,
        val_beam_size: int = 1,
        val_caption_images: int = 500,
        num_sample_captions: int = 5,
        metric_tokenizer: str = "auto",
        meteor: bool = True,
        val_meteor: bool = False,
        spice: bool = False,
        test_output: str | None = None,
        predict_output: str | None = None,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: LRSchedulerCallable | None = None,
        monitor: str = "val/loss",
    ) -> None:
        super().__init__(optimizer=optimizer, lr_scheduler=lr_scheduler, monitor=monitor)
        # Decoding, scoring and output settings are not architecture: they stay out of the saved
        # hyper-parameters, so `test`/`predict --ckpt_path` (which re-applies a checkpoint's
        # hyper-parameters over the command line) honours the values given at evaluation time.
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", *EVALUATION_SETTINGS])
        self.beam_size, self.length_penalty, self.max_caption_length = beam_size, length_penalty, max_caption_length
        self.val_beam_size, self.val_caption_images = val_beam_size, val_caption_images
        self.num_sample_captions, self.test_output, self.predict_output = num_sample_captions, test_output, predict_output
        if num_classes < 5:
            raise ValueError(f"CaptioningTask needs num_classes >= 5 (4 specials + a word), got {num_classes} (link it from the datamodule)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"CaptioningTask needs dropout in [0, 1), got {dropout} (set model.init_args.dropout)")
        for key, value in (("embed_dim", embed_dim), ("hidden_size", hidden_size), ("num_layers", num_layers), ("attention_dim", attention_dim), ("max_caption_length", max_caption_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CaptioningTask needs {key} to be an integer >= 1, got {value!r} (set model.init_args.{key})")
        if val_caption_images < -1:
            raise ValueError(f"CaptioningTask needs val_caption_images >= -1 (-1 = all, 0 = none), got {val_caption_images} (set model.init_args.val_caption_images)")
        check_search_settings(beam_size, 1, 0.0, max_caption_length)
        check_search_settings(val_beam_size, 1, 0.0, max_caption_length)
        self.scorer = CaptionScorer(metric_tokenizer, meteor=meteor, spice=spice)
        self.val_scorer = self.scorer if val_meteor or not meteor else CaptionScorer(metric_tokenizer, meteor=False, spice=spice)
        if feature_cache is not None and not freeze_encoder:
            raise ValueError(f"feature_cache={feature_cache!r} needs freeze_encoder: true (a fine-tuned encoder changes its features every step)")
        self.encoder = ResNetEncoder(encoder, weights, trainable=not freeze_encoder)
        self.feature_cache = FeatureCache(feature_cache, encoder) if feature_cache is not None else None
        self.decoder = ShowTellDecoder(num_classes, self.encoder.out_channels, embed_dim, hidden_size, num_layers, dropout, attention, attention_dim)
        self.head = build_head(head, self.decoder.output_size, num_classes)
        self.unigram_bias_init = unigram_bias_init
        self._checkpoint_decoder: tuple[Vocabulary, TextTokenizer] | None = None
        self._reset_eval_state()

    # ------------------------------------------------------------------ model
    def encode(self, images: Tensor, image_ids: Tensor | None = None) -> Tensor:
        """Annotation vectors, from the feature cache when one is configured.

        Shape: images ``(B, 3, S, S)``, image_ids ``(B,)`` -> ``(B, P, C)``.
        """
        if self.feature_cache is not None and image_ids is not None:
            return self.feature_cache(self.encoder, images, image_ids)
        return self.encoder(images)

    def forward(self, images: Tensor, caption_input: Tensor, caption_image: Tensor, image_ids: Tensor | None = None) -> Tensor:
        """Teacher-forced decoder states.

        Shape:
            images ``(B, 3, S, S)``, caption_input ``(N, T)``, caption_image ``(N,)`` (each
            caption's image row), image_ids ``(B,)`` -> ``(N, T, D)``.
        """
        annotations = self.encode(images, image_ids)  # (B, P, C): the CNN runs once per image
        return self.decoder(annotations.index_select(0, caption_image), caption_input)  # (N, T, D)

    def token_nll(self, batch: dict[str, Any]) -> Tensor:
        """Per-token NLL ``(N, T)``, zero at padding."""
        hidden = self(batch["images"], batch["caption_input"], batch["caption_image"], batch.get("image_id"))
        return self.head(hidden, batch["caption_output"])

    def training_step(self, batch: dict[str, Any] | None, batch_idx: int) -> Tensor | None:
        if batch is None:  # every image of the batch was skipped as unreadable
            return None
        tokens = (batch["caption_output"] != IGNORE_INDEX).sum().clamp(min=1)
        nll_sum = self.token_nll(batch).sum()
        # Ranks hold captions of different lengths: dividing by the global mean token count makes
        # the DDP-averaged step the per-token mean over every rank's captions (global_mean_count).
        loss = nll_sum / global_mean_count(tokens)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=int(tokens), sync_dist=True)
        self.log("train/ppl", torch.exp(nll_sum.detach() / tokens), batch_size=int(tokens))  # this rank's captions
        self.log_head_stats("train")
        return self.add_head_regularization(loss, "train")

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def caption(self, images: Tensor, beam_size: int | None = None, greedy_when_one: bool = True, image_ids: Tensor | None = None) -> list[Hypothesis]:
        """Best caption of every image (``beam_size`` 1 runs greedy search unless
        ``greedy_when_one`` is false, which runs the beam search with one beam).

        Shape: images ``(B, 3, S, S)`` -> ``B`` hypotheses (token ids without EOS).
        """
        beam_size = self.beam_size if beam_size is None else beam_size
        state = self.decoder.start(self.encode(images, image_ids))
        budget = torch.full((images.size(0),), self.max_caption_length, dtype=torch.long)

        greedy = beam_size == 1 and greedy_when_one
        width = 1 if greedy else 2 * beam_size  # tokens per row a search can select (decoding.py)

        def step(tokens: Tensor, state: Any) -> tuple[Tensor, Any]:
            hidden, state = self.decoder.step(tokens[:, -1], state)  # (N, D)
            return head_candidates(self.head, hidden, width), state  # the head's top `width` tokens per row

        B = images.size(0)
        if greedy:
            return greedy_search(step, state, B, BOS_ID, EOS_ID, budget, images.device)
        beams = beam_search(step, state, B, BOS_ID, EOS_ID, budget, beam_size, self.length_penalty, 1, True, images.device)
        return [hyps[0] if hyps else Hypothesis([], -math.inf, -math.inf) for hyps in beams]

    def decode_text(self, ids: list[int]) -> str:
        """Caption text with the data's (or the checkpoint's) vocabulary and tokenizer."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "decode"):
            return datamodule.decode(ids)
        if self._checkpoint_decoder is None:
            raise ValueError("no vocabulary to decode captions with: attach a captioning datamodule or load a checkpoint that stores one")
        vocab, tokenizer = self._checkpoint_decoder
        return decode_ids(ids, vocab, tokenizer)

    # ------------------------------------------------------------------ evaluation
    def _reset_eval_state(self) -> None:
        self._nll_sum = torch.zeros((), dtype=torch.float64)
        self._token_count = torch.zeros((), dtype=torch.float64)
        self._image_count = torch.zeros((), dtype=torch.float64)
        self._outputs: list[tuple[int, int, str, list[str]]] = []  # (index, image_id, caption, references)

    def on_validation_epoch_start(self) -> None:
        self._reset_eval_state()

    on_test_epoch_start = on_validation_epoch_start
    on_predict_epoch_start = on_validation_epoch_start

    def _evaluate(self, batch: dict[str, Any] | None, beam_size: int, limit: int) -> None:
        if batch is None:
            return
        nll = self.token_nll(batch)
        self._nll_sum = self._nll_sum + nll.detach().double().sum().cpu()
        self._token_count = self._token_count + (batch["caption_output"] != IGNORE_INDEX).sum().cpu().double()
        self._image_count = self._image_count + (batch["scored"].sum().cpu().double() if "scored" in batch else len(batch["index"]))
        if self.trainer.sanity_checking:
            return  # scores of two sanity batches are discarded anyway; skip the Java start-up
        scored = batch["scored"].tolist() if "scored" in batch else [True] * len(batch["index"])
        rows = [r for r, i in enumerate(batch["index"].tolist()) if scored[r] and (limit < 0 or i < limit)]
        if not rows:
            return
        chosen = torch.tensor(rows, device=batch["images"].device)
        hypotheses = self.caption(batch["images"][chosen], beam_size, image_ids=batch["image_id"][chosen.cpu()])
        for r, hypothesis in zip(rows, hypotheses):
            self._outputs.append((int(batch["index"][r]), int(batch["image_id"][r]), self.decode_text(hypothesis.tokens), list(batch["references"][r])))

    def validation_step(self, batch: dict[str, Any] | None, batch_idx: int) -> None:
        self._evaluate(batch, self.val_beam_size, self.val_caption_images)

    def test_step(self, batch: dict[str, Any] | None, batch_idx: int) -> None:
        self._evaluate(batch, self.beam_size, -1)

    def _gather(self, items: list) -> list:
        """Every rank's items in data order. Evaluation shards hold every image once (padding
        images are never decoded); keeping one item per image id also guards predict."""
        if self.trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            parts: list[list] = [None] * self.trainer.world_size  # type: ignore[list-item]
            torch.distributed.all_gather_object(parts, items)
            items = [item for part in parts for item in part]
        unique = {item[1]: item for item in items}
        return sorted(unique.values(), key=lambda item: item[0])

    def _finish_evaluation(self, stage: str) -> dict[str, float]:
        nll_sum = self.trainer.strategy.reduce(self._nll_sum.to(self.device), reduce_op="sum")
        tokens = self.trainer.strategy.reduce(self._token_count.to(self.device), reduce_op="sum")
        loss = float(nll_sum / tokens.clamp(min=1))
        self.log(f"{stage}/loss", loss, sync_dist=False)
        self.log(f"{stage}/ppl", math.exp(min(loss, 50.0)), sync_dist=False)
        # Summed over ranks: each evaluation image (and each of its reference tokens) counted once.
        images = self.trainer.strategy.reduce(self._image_count.to(self.device), reduce_op="sum")
        self.log(f"{stage}/tokens", float(tokens), sync_dist=False)
        self.log(f"{stage}/images", float(images), sync_dist=False)
        outputs = self._gather(self._outputs)
        if not outputs:
            return {"loss": loss}
        scores: dict[str, float] = {}
        if self.trainer.is_global_zero and not any(o[2].strip() for o in outputs):
            # Scores of 0 alone do not say why; an untrained or collapsed decoder ends at once.
            rank_zero_warn(
                f"{stage} epoch {self.current_epoch}: all {len(outputs)} generated captions are empty (the decoder "
                f"ends every caption at once), so the caption scores are 0; train longer or check the data and learning rate"
            )
        if self.trainer.is_global_zero:
            references = {o[1]: o[3] for o in outputs}
            scorer = self.val_scorer if stage == "val" else self.scorer
            scores = scorer.score(references, {o[1]: o[2] for o in outputs})
        scores = self.trainer.strategy.broadcast(scores, src=0)  # scored once, logged everywhere
        for name, value in scores.items():
            self.log(f"{stage}/{name}", value, sync_dist=False)
        if self.trainer.is_global_zero:
            summary = " ".join(f"{k} {v:.3f}" for k, v in scores.items())
            print(f"{stage} epoch {self.current_epoch}: {summary} ({len(outputs)} images, loss {loss:.3f})")
            self._write_samples(stage, outputs)
        return {"loss": loss, **scores}

    def _write_samples(self, stage: str, outputs: list) -> None:
        samples = outputs[: self.num_sample_captions]
        if not samples:
            return
        text = "\n\n".join(f"**image {image_id}:** {caption}  \n**reference:** {refs[0]}" for _, image_id, caption, refs in samples)
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(f"{stage}/samples", text, self.global_step)

    def on_validation_epoch_end(self) -> None:
        self._finish_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._finish_evaluation("test")
        if self.test_output and self.trainer.is_global_zero:
            write_results(self.test_output, self._gather(self._outputs))

    # ------------------------------------------------------------------ predict
    def predict_step(self, batch: dict[str, Any] | None, batch_idx: int) -> list[dict[str, Any]]:
        if batch is None:
            return []
        results = []
        for r, hypothesis in enumerate(self.caption(batch["images"], self.beam_size, image_ids=batch["image_id"])):
            caption = self.decode_text(hypothesis.tokens)
            self._outputs.append((int(batch["index"][r]), int(batch["image_id"][r]), caption, []))
            results.append({"image_id": int(batch["image_id"][r]), "caption": caption})
        return results

    def on_predict_epoch_end(self) -> None:
        outputs = self._gather(self._outputs)
        if self.trainer.is_global_zero:
            path = self.predict_output or os.path.join(self.trainer.default_root_dir, "captions.json")
            write_results(path, outputs)
            print(f"wrote {len(outputs)} captions to {path}")

    # ------------------------------------------------------------------ checkpoints
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("datamodule_state") or {}
        if "caption_itos" in state:
            self._checkpoint_decoder = (
                Vocabulary.from_itos(state["caption_itos"], unk=UNK),
                TextTokenizer.from_state(state["caption_tokenizer"]),
            )


def write_results(path: str, outputs: list[tuple[int, int, str, list[str]]]) -> None:
    """COCO results JSON: ``[{"image_id": int, "caption": str}]``, written atomically."""
    results = [{"image_id": image_id, "caption": caption} for _, image_id, caption, _ in outputs]
    write_atomically(path, json.dumps(results, indent=1) + "\n")
