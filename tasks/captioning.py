"""Image captioning: an image encoder and a caption decoder as components; any head as output layer.

``model.init_args.encoder`` is the image encoder (``tasks.encoders.ResNetEncoder``: a torchvision
ResNet trunk, optionally frozen, its features optionally cached on disk by the task) and
``model.init_args.decoder`` the caption decoder (``tasks.encoders.ShowTellDecoder``: NIC's LSTM,
optionally with soft attention), built by the task with the caption vocabulary size (linked from
the data) and the encoder's channels.

Decoding is :mod:`tasks.decoding` (greedy and beam search, shared with translation): the
step function embeds the last token, runs one LSTM step and returns the head's top tokens
(``tasks.decoding.head_candidates``). Evaluation is :mod:`tasks.seq2seq`: ``val/loss`` (token NLL
over every reference caption, what checkpointing monitors) and ``val/ppl`` each epoch; COCO
metrics (:mod:`tasks.caption_metrics`) on the first ``val_caption_images`` validation images
decoded with ``val_beam_size``, and on the whole test split with ``beam_size``. Captions of all
ranks are gathered and scored once.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.aggregation import SumMetric

from datamodules.captioning import BOS_ID, EOS_ID
from datamodules.files import check_output_file, write_atomically
from heads.validation import check_positive_int
from tasks.base import HeadSpec, build_head, built_modules
from tasks.caption_metrics import CaptionScorer
from tasks.decoding import Hypothesis, beam_search, check_search_settings, greedy_search, head_candidates
from tasks.encoders.resnet import ResNetEncoder
from tasks.encoders.resnet import FeatureCache
from tasks.encoders.show_tell import ShowTellDecoder
from tasks.seq2seq import Generated, GenerationTask, compute_all_ranks

EVALUATION_SETTINGS = (
    "beam_size", "length_penalty", "max_caption_length", "val_beam_size", "val_caption_images", "num_sample_captions",
    "metric_tokenizer", "meteor", "val_meteor", "spice", "test_output", "predict_output",
)
#: ``decoder`` argument: a class_path block (CLI) or any callable taking ``(num_classes, feature_dim)``.
DecoderSpec = Callable[[int, int], ShowTellDecoder]


class CaptioningTask(GenerationTask):
    """Image captioning (NIC, optionally with soft attention); the output layer is any head.

    Args:
        num_classes: caption vocabulary size (linked from ``data.num_classes``).
        encoder: image encoder with ``out_channels`` (``class_path`` + ``init_args``); default
            ``ResNetEncoder()`` (ResNet-18, random initialisation, trainable).
        decoder: caption decoder (``class_path`` + ``init_args``), built with ``(num_classes,
            encoder.out_channels)``; default ``ShowTellDecoder`` with its defaults.
        head: output layer (short name or class_path + init_args).
        feature_cache: directory caching a frozen encoder's features per image id (needs
            ``encoder.init_args.trainable: false``; see :class:`tasks.encoders.resnet.FeatureCache`).
        unigram_bias_init: start the head's class biases at the training captions' unigram
            (pieces plus one EOS per caption) when fitting from scratch, as the language-model
            and translation tasks do by default; off by default here only because the synthetic
            config's published results were measured without it (the COCO config turns it on).
        beam_size / length_penalty: test and predict decoding (``length_penalty`` is the
            exponent of the length normaliser, 0 = plain sum of log-probabilities).
        max_caption_length: generated tokens per caption at most (EOS included).
        val_beam_size: decoding for validation metrics (1 = greedy).
        val_caption_images: validation images (the first ones) captioned for COCO metrics
            each epoch; 0 disables, -1 captions all.
        num_sample_captions: captions written to TensorBoard as text per evaluation.
        metric_tokenizer / meteor / spice: see :class:`tasks.caption_metrics.CaptionScorer`.
        val_meteor: also compute METEOR at validation (its JVM start-up and paraphrase
            table cost seconds per evaluation; test always includes it).
        test_output / predict_output: COCO results JSON files (``[{"image_id", "caption"}]``);
            ``predict_output`` defaults to ``<default_root_dir>/captions.json``.
        compile: ``torch.compile`` the image encoder, the caption decoder and the head at setup: ``true``, or a mapping of
            torch.compile options (``{mode: max-autotune}``); a run-time choice, not saved with the
            checkpoint (docs/benchmarks.md, "torch.compile").
    """

    runtime_options = ("compile", "feature_cache", *EVALUATION_SETTINGS)

    compiled_modules = ("encoder", "decoder", "head")
    encoder_modules = ("encoder", "decoder")
    hparams_metrics = ("CIDEr-D",)

    target_key = "caption_output"

    def __init__(
        self,
        num_classes: int,
        encoder: nn.Module | None = None,
        decoder: DecoderSpec | None = None,
        head: HeadSpec = "softmax",
        feature_cache: str | None = None,
        unigram_bias_init: bool = False,
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
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__(optimizer=optimizer, lr_scheduler=lr_scheduler, monitor=monitor, compile=compile)
        # Decoding, scoring and output settings are not architecture: they stay out of the saved
        # hyper-parameters, so `test`/`predict --ckpt_path` (which re-applies a checkpoint's
        # hyper-parameters over the command line) honours the values given at evaluation time.
        # A built encoder (from Python, or from a checkpoint's class_path + init_args by Lightning's
        # instantiator) is not saved; through the CLI the encoder is its class_path/init_args dict.
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", *self.runtime_options, *built_modules(encoder=encoder)])
        for key in ("encoder", "decoder", "head"):
            # Built modules and callables passed from Python are not configuration (checkpoints stay
            # loadable with weights_only); through the CLI they are class_path/init_args dicts.
            if not isinstance(self.hparams.get(key), (str, dict, type(None))):
                self.hparams.pop(key, None)
        self.beam_size, self.length_penalty, self.max_caption_length = beam_size, length_penalty, max_caption_length
        self.val_beam_size, self.val_caption_images = val_beam_size, val_caption_images
        check_output_file(test_output, "model.init_args.test_output")
        check_output_file(predict_output, "model.init_args.predict_output")
        self.num_sample_captions, self.test_output, self.predict_output = num_sample_captions, test_output, predict_output
        if num_classes < 5:
            raise ValueError(f"CaptioningTask needs num_classes >= 5 (4 specials + a word), got {num_classes} (link it from the datamodule)")
        check_positive_int(max_caption_length, "max_caption_length", "CaptioningTask", where="model.init_args")
        if val_caption_images < -1:
            raise ValueError(f"CaptioningTask needs val_caption_images >= -1 (-1 = all, 0 = none), got {val_caption_images} (set model.init_args.val_caption_images)")
        check_search_settings(beam_size, 1, 0.0, max_caption_length)
        check_search_settings(val_beam_size, 1, 0.0, max_caption_length)
        self.scorer = CaptionScorer(metric_tokenizer, meteor=meteor, spice=spice)
        self.val_scorer = self.scorer if val_meteor or not meteor else CaptionScorer(metric_tokenizer, meteor=False, spice=spice)
        self.encoder = ResNetEncoder() if encoder is None else encoder
        if not isinstance(self.encoder, nn.Module) or not isinstance(getattr(self.encoder, "out_channels", None), int):
            raise ValueError(
                f"CaptioningTask needs an encoder nn.Module with an integer out_channels, got {type(self.encoder).__name__} "
                f"(set model.init_args.encoder.class_path, e.g. tasks.encoders.ResNetEncoder)"
            )
        if feature_cache is not None and getattr(self.encoder, "trainable", True):
            raise ValueError(
                f"feature_cache={feature_cache!r} needs a frozen encoder (a fine-tuned encoder changes its features every step; "
                f"set model.init_args.encoder.init_args.trainable: false)"
            )
        self.feature_cache = FeatureCache(feature_cache, getattr(self.encoder, "arch", type(self.encoder).__name__)) if feature_cache is not None else None
        self.decoder = (decoder or ShowTellDecoder)(num_classes, self.encoder.out_channels)
        self.head = build_head(head, self.decoder.output_size, num_classes)
        self.unigram_bias_init = unigram_bias_init
        self.image_count = SumMetric()  # evaluation images, summed over DDP ranks

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

    def head_input(self, batch: dict[str, Any]) -> Tensor:
        """Decoder hidden states under teacher forcing ``(N, T, d)`` of every caption of the batch."""
        return self(batch["images"], batch["caption_input"], batch["caption_image"], batch.get("image_id"))

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

    # ------------------------------------------------------------------ evaluation
    def reset_evaluation(self) -> None:
        super().reset_evaluation()
        self.image_count.reset()

    def evaluate_batch(self, batch: dict[str, Any] | None, beam_size: int, limit: int) -> None:
        if batch is not None:
            self.image_count.update(batch["scored"].sum().double() if "scored" in batch else float(len(batch["index"])))
        super().evaluate_batch(batch, beam_size, limit)

    def selected_rows(self, batch: dict[str, Any], limit: int) -> list[int]:
        if self.trainer.sanity_checking:
            return []  # scores of two sanity batches are discarded anyway; skip the Java start-up
        scored = batch["scored"].tolist() if "scored" in batch else [True] * len(batch["index"])
        return [r for r, i in enumerate(batch["index"].tolist()) if scored[r] and (limit < 0 or i < limit)]

    def generate(self, batch: dict[str, Any], rows: list[int], beam_size: int) -> list[Generated]:
        chosen = torch.tensor(rows, device=batch["images"].device)
        hypotheses = self.caption(batch["images"][chosen], beam_size, image_ids=batch["image_id"][chosen.cpu()])
        return [Generated(int(batch["index"][r]), self.decode_text(h.tokens), list(batch["references"][r]), key=int(batch["image_id"][r]))
                for r, h in zip(rows, hypotheses)]

    def validation_step(self, batch: dict[str, Any] | None, batch_idx: int) -> None:
        self.evaluate_batch(batch, self.val_beam_size, self.val_caption_images)

    def test_step(self, batch: dict[str, Any] | None, batch_idx: int) -> None:
        self.evaluate_batch(batch, self.beam_size, -1)

    def finish_evaluation(self, stage: str) -> dict[str, float]:
        # Summed over ranks: each evaluation image counted once (padding images are not scored).
        self.log_reduced(f"{stage}/images", float(compute_all_ranks(self.image_count)))
        return super().finish_evaluation(stage)

    def score_outputs(self, stage: str, outputs: list[Generated], loss: float) -> dict[str, float]:
        scores: dict[str, float] = {}
        if self.trainer.is_global_zero and not any(o.text.strip() for o in outputs):
            # Scores of 0 alone do not say why; an untrained or collapsed decoder ends at once.
            rank_zero_warn(
                f"{stage} epoch {self.current_epoch}: all {len(outputs)} generated captions are empty (the decoder "
                f"ends every caption at once), so the caption scores are 0; train longer or check the data and learning rate"
            )
        if self.trainer.is_global_zero:
            scorer = self.val_scorer if stage == "val" else self.scorer
            scores = scorer.score({o.key: o.references for o in outputs}, {o.key: o.text for o in outputs})
        scores = self.trainer.strategy.broadcast(scores, src=0)  # scored once, logged everywhere
        for name, value in scores.items():
            self.log_reduced(f"{stage}/{name}", value, prog_bar=name == "CIDEr-D")
        self.log_hparams(stage, scores)
        if self.trainer.is_global_zero:
            summary = " ".join(f"{k} {v:.3f}" for k, v in scores.items())
            print(f"{stage} epoch {self.current_epoch}: {summary} ({len(outputs)} images, loss {loss:.3f})")
            self._write_samples(stage, outputs)
        return scores

    def _write_samples(self, stage: str, outputs: list[Generated]) -> None:
        samples = outputs[: self.num_sample_captions]
        if not samples:
            return
        text = "\n\n".join(f"**image {o.key}:** {o.text}  \n**reference:** {o.references[0]}" for o in samples)
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(f"{stage}/samples", text, self.global_step)

    def on_test_epoch_end(self) -> None:
        self.finish_evaluation("test")
        if self.test_output and self.trainer.is_global_zero:
            write_results(self.test_output, self.gather(self.outputs))

    # ------------------------------------------------------------------ predict
    def predict_step(self, batch: dict[str, Any] | None, batch_idx: int) -> list[dict[str, Any]]:
        if batch is None:
            return []
        results = []
        for r, hypothesis in enumerate(self.caption(batch["images"], self.beam_size, image_ids=batch["image_id"])):
            caption = self.decode_text(hypothesis.tokens)
            self.outputs.append(Generated(int(batch["index"][r]), caption, key=int(batch["image_id"][r])))
            results.append({"image_id": int(batch["image_id"][r]), "caption": caption})
        return results

    def on_predict_epoch_end(self) -> None:
        outputs = self.gather(self.outputs)
        if self.trainer.is_global_zero:
            path = self.predict_output or os.path.join(self.trainer.default_root_dir, "captions.json")
            write_results(path, outputs)
            print(f"wrote {len(outputs)} captions to {path}")


def write_results(path: str, outputs: list[Generated]) -> None:
    """COCO results JSON: ``[{"image_id": int, "caption": str}]``, written atomically."""
    results = [{"image_id": o.key, "caption": o.text} for o in outputs]
    write_atomically(path, json.dumps(results, indent=1) + "\n")
