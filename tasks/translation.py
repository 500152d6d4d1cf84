"""Encoder-decoder translation with any output head, decoded by greedy or beam search.

The network is a component, ``model.init_args.network: {class_path, init_args}``, built by the
task with the two vocabulary sizes the data knows (:class:`tasks.encoders.seq2seq.Seq2SeqNetwork`):
``tasks.encoders.LuongAttentionSeq2Seq`` (LSTM with Luong attention, the default) or
``tasks.encoders.TransformerSeq2Seq`` (Vaswani et al. 2017; the paper's base and big sizes are
``init_args`` blocks of the shipped configs). The head turns the decoder's hidden states into
target-word distributions, owns the loss and scores every decoding step (``head.topk``, see
:func:`tasks.decoding.head_candidates`). Training adds label smoothing (Vaswani §5.4) and the
inverse-square-root warm-up (Eq. 3, :class:`InverseSquareRootLR`).

Metrics (:mod:`tasks.seq2seq`): validation loss/perplexity from summed token NLL; BLEU
(sacrebleu, 13a) and chrF on detokenised text, computed once on all ranks' gathered hypotheses,
with sacrebleu's signature printed and logged beside every score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.loggers import TensorBoardLogger
from sacrebleu.metrics import BLEU, CHRF
from torch import Tensor

from datamodules.files import check_output_file
from datamodules.translation import BOS_ID, EOS_ID, TranslationDataModule, check_tokenizer_state
from tasks.base import IGNORE_INDEX, HeadSpec, build_head
from tasks.code_search import CODE_OFFSET, CodeStep, code_inputs
from tasks.decoding import DECODE_LIMIT, Hypothesis, beam_search, check_search_settings, greedy_search, head_candidates, max_lengths
from tasks.encoders.seq2seq import LuongAttentionSeq2Seq, Seq2SeqNetwork
from tasks.seq2seq import Generated, GenerationTask, write_lines

#: ``network`` argument: a class_path block (CLI) or any callable taking
#: ``(source_vocab_size, target_vocab_size)``, e.g. ``functools.partial(LuongAttentionSeq2Seq, hidden_size=64)``.
NetworkSpec = Callable[[int, int], Seq2SeqNetwork]


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


def check_code_inputs(head: str, label_smoothing: float, tie_weights: bool) -> None:
    """One-line errors for settings a decoder over code inputs cannot have."""
    if label_smoothing > 0:
        raise ValueError(
            f"label_smoothing {label_smoothing} needs a word distribution per decoder state, which {head} (code "
            f"inputs) does not give from one state: set model.init_args.label_smoothing 0, or use heads.HybridLightRNN"
        )
    if tie_weights:
        raise ValueError(
            f"tie_weights needs word embeddings, but with {head} the decoder reads codes: set "
            f"model.init_args.tie_weights false"
        )


class TranslationTask(GenerationTask):
    """Sequence-to-sequence translation; the network and the output layer are components.

    Args:
        num_classes: target vocabulary size (linked from ``data.num_classes``).
        source_vocab_size: source vocabulary size (from ``data.source_vocab_size``).
        network: the encoder-decoder (``class_path`` + ``init_args``), built with
            ``(source_vocab_size, num_classes)``; default ``LuongAttentionSeq2Seq`` with its defaults.
        head: output layer (short name or class_path + init_args). With
            ``heads.lightrnn.HybridLightRNNCodes`` the decoder reads and predicts codes (seed 002
            Eq. 4; :mod:`tasks.code_search`): no label smoothing or tying then.
        tie_weights: share the decoder's input embedding with the head's class embeddings.
        unigram_bias_init: start the head's class biases at the training targets' unigram (log
            frequencies, EOS included) when fitting from scratch. Heads behind ``tanh`` latent
            layers (MoS, MoC) otherwise spend their first epochs learning it.
        label_smoothing: epsilon of label smoothing (needs the head's full ``log_prob``).
        beam_size / length_penalty / max_len_a / max_len_b / nbest / early_stopping: test
            and predict decoding (see :mod:`tasks.decoding`).
        val_beam_size: beam used for validation BLEU (1 = greedy).
        val_bleu_sentences: validation sentences (the first ones) decoded for BLEU each
            epoch; 0 disables, -1 decodes all.
        num_sample_translations: validation samples written to TensorBoard as text.
        test_output / predict_output: files receiving detokenised hypotheses, one line per
            source line, in input order.
        compile: ``torch.compile`` the head (the network is called through its encode / decode methods, which a
            module's compile does not wrap) at setup: ``true``, or a mapping of
            torch.compile options (``{mode: max-autotune}``); a run-time choice, not saved with the
            checkpoint (docs/benchmarks.md, "torch.compile").
    """

    runtime_options = ("compile", *DECODING_SETTINGS)

    #: on_load_checkpoint gives the datamodule the checkpoint's tokenizers and vocabularies.
    adopts_checkpoint_vocabulary = True
    encoder_modules = ("network",)
    hparams_metrics = ("bleu",)
    target_key = "target_output"

    def __init__(
        self,
        num_classes: int,
        source_vocab_size: int,
        network: NetworkSpec | None = None,
        head: HeadSpec = "softmax",
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
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__(optimizer=optimizer, lr_scheduler=lr_scheduler, monitor=monitor, compile=compile)
        # Decoding and output settings are run-time choices, not part of the trained model: kept
        # out of the saved hyper-parameters so a checkpoint never overrides the command line
        # (LightningCLI re-applies a checkpoint's hyper-parameters on --ckpt_path).
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", *self.runtime_options])
        for key in ("network", "head"):
            # Built callables passed from Python are not configuration (checkpoints stay loadable
            # with weights_only); through the CLI they are class_path/init_args dicts and stay.
            if not isinstance(self.hparams.get(key), (str, dict, type(None))):
                self.hparams.pop(key, None)
        self.decoding = DecodingSettings(
            beam_size, length_penalty, max_len_a, max_len_b, nbest, early_stopping, val_beam_size,
            val_bleu_sentences, num_sample_translations, test_output, predict_output,
        )
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"TranslationTask needs label_smoothing in [0, 1), got {label_smoothing} (set model.init_args.label_smoothing)")
        for key, value in (("num_classes", num_classes), ("source_vocab_size", source_vocab_size)):
            if value < 5:
                raise ValueError(f"TranslationTask needs {key} >= 5 (4 specials + a word), got {value} (link it from the datamodule)")
        check_search_settings(beam_size, nbest, max_len_a, max_len_b)
        check_search_settings(val_beam_size, 1, max_len_a, max_len_b)
        check_output_file(test_output, "model.init_args.test_output")
        check_output_file(predict_output, "model.init_args.predict_output")
        self.network = (network or LuongAttentionSeq2Seq)(source_vocab_size, num_classes)
        if not isinstance(self.network, Seq2SeqNetwork):
            raise ValueError(
                f"TranslationTask needs a Seq2SeqNetwork, got {type(self.network).__name__} "
                f"(set model.init_args.network.class_path, e.g. tasks.encoders.LuongAttentionSeq2Seq)"
            )
        self.head = build_head(head, self.network.output_size, num_classes)
        # A head over code sequences (heads.lightrnn.HybridLightRNNCodes, seed 002 Eq. 4): the
        # decoder reads the head's codes, so it embeds the code dictionary (tasks/code_search.py).
        self.code_inputs = bool(getattr(self.head, "code_inputs", False))
        if self.code_inputs:
            check_code_inputs(type(self.head).__name__, label_smoothing, tie_weights)
            self.network = (network or LuongAttentionSeq2Seq)(source_vocab_size, self.head.num_input_codes + CODE_OFFSET)
        self.unigram_bias_init = unigram_bias_init
        if tie_weights:
            self.head.tie_to(self.network.target_embedding)

    # ------------------------------------------------------------------ model
    def forward(self, source: Tensor, source_lengths: Tensor, target_input: Tensor) -> Tensor:
        """Decoder hidden states under teacher forcing.

        Shape:
            source ``(B, S)``, source_lengths ``(B,)``, target_input ``(B, T)`` -> ``(B, T, d)``.
        """
        return self.network.decode(target_input, self.network.encode(source, source_lengths))

    def head_input(self, batch: dict[str, Any]) -> Tensor:
        """Decoder hidden states under teacher forcing ``(B, T, d)``; ``(B, 2T, d)`` when the decoder reads codes (the
        head's code sequence, two positions per word)."""
        target_input = batch["target_input"]
        if self.code_inputs:
            target_input = code_inputs(self.head, target_input, batch["target_output"])  # (B, 2T)
        return self(batch["source"], batch["source_lengths"], target_input)

    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        if self.code_inputs:
            raise ValueError(f"{type(self.head).__name__} with code inputs has two hidden states per target word, not one: "
                             f"the analysis tools read models whose decoder reads words")
        return super().hidden_states(batch)

    def training_objective(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        epsilon = self.hparams.label_smoothing
        if epsilon == 0:
            return super().training_objective(batch)
        # Label smoothing (Szegedy et al. 2016; Vaswani §5.4): mix the NLL with the cross-entropy
        # to the uniform distribution, which needs all log-probabilities.
        target = batch["target_output"]
        log_probs = self.head.log_prob(self.head_input(batch))  # (B, T, V)
        valid = target != IGNORE_INDEX
        nll = -log_probs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
        uniform = -log_probs.mean(dim=-1)  # (B, T)
        return (((1 - epsilon) * nll + epsilon * uniform) * valid).sum(), (nll * valid).sum()

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def translate(self, source: Tensor, source_lengths: Tensor, beam_size: int | None = None, nbest: int = 1) -> list[list[Hypothesis]]:
        """Decode a batch; ``nbest`` hypotheses per sentence (beam 1 runs greedy search); both
        searches score a step by the head's ``topk`` (see :func:`tasks.decoding.head_candidates`).

        Shape: ``source (B, S)``, ``source_lengths (B,)`` (EOS included).
        """
        hp = self.decoding
        beam_size = hp.beam_size if beam_size is None else beam_size
        state = self.network.encode(source, source_lengths)
        budget = max_lengths(source_lengths - 1, hp.max_len_a, hp.max_len_b, DECODE_LIMIT)  # (B,)

        greedy = beam_size == 1 and nbest == 1
        width = 1 if greedy else 2 * beam_size  # tokens per row a search can select (decoding.py)

        def step(tokens: Tensor, state: Any) -> tuple[Tensor, Any]:
            hidden, state = self.network.decode_step(tokens, state)  # (N, d)
            return head_candidates(self.head, hidden, width), state  # the head's top `width` tokens per row

        B = source.size(0)
        if self.code_inputs:  # the decoder reads codes: a word's candidates need its rows' decoder steps
            step, state = CodeStep(self.network, self.head, width), CodeStep.initial(state, B, source.device)
        if greedy:
            return [[h] for h in greedy_search(step, state, B, BOS_ID, EOS_ID, budget, source.device)]
        return beam_search(step, state, B, BOS_ID, EOS_ID, budget, beam_size, hp.length_penalty, nbest, hp.early_stopping, source.device)

    # ------------------------------------------------------------------ evaluation
    def selected_rows(self, batch: dict[str, Any], limit: int) -> list[int]:
        return [row for row, line in enumerate(batch["index"].tolist()) if limit < 0 or line < limit]

    def generate(self, batch: dict[str, Any], rows: list[int], beam_size: int) -> list[Generated]:
        chosen = torch.tensor(rows, device=batch["source"].device)
        hypotheses = self.translate(batch["source"][chosen], batch["source_lengths"][chosen], beam_size)
        return [Generated(int(batch["index"][row]), self.decode_text(hyps[0].tokens), [batch["reference"][row]], batch["source_text"][row])
                for row, hyps in zip(rows, hypotheses)]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluate_batch(batch, self.decoding.val_beam_size, self.decoding.val_bleu_sentences)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluate_batch(batch, self.decoding.beam_size, -1)

    def score_outputs(self, stage: str, outputs: list[Generated], loss: float) -> dict[str, float]:
        self.log_reduced(f"{stage}/sentences", float(len(outputs)))  # decoded sentences, all ranks
        hypotheses = [o.text for o in outputs]
        references = [o.references[0] for o in outputs]
        bleu, chrf = BLEU(), CHRF()  # 13a tokenizer, exponential smoothing: sacrebleu defaults
        bleu_score = bleu.corpus_score(hypotheses, [references])
        chrf_score = chrf.corpus_score(hypotheses, [references])
        self.log_reduced(f"{stage}/bleu", bleu_score.score, prog_bar=True)
        self.log_reduced(f"{stage}/chrf", chrf_score.score)
        self.log_hparams(stage, {"bleu": bleu_score.score})
        self.last_signatures = {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())}
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            print(f"{stage} epoch {self.current_epoch}: {bleu_score} ({len(outputs)} sentences) | signature {bleu.get_signature()}")
            print(f"{stage} epoch {self.current_epoch}: {chrf_score} | signature {chrf.get_signature()}")
            self._write_text_logs(stage, outputs, bleu_score, bleu.get_signature())
        return {"bleu": bleu_score.score, "chrf": chrf_score.score}

    def _write_text_logs(self, stage: str, outputs: list[Generated], bleu_score: Any, signature: Any) -> None:
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                writer = logger.experiment
                writer.add_text(f"{stage}/bleu_signature", f"{bleu_score} `{signature}`", self.global_step)
                samples = outputs[: self.decoding.num_sample_translations]
                table = "\n\n".join(f"**source:** {o.source}  \n**reference:** {o.references[0]}  \n**hypothesis:** {o.text}" for o in samples)
                if table:
                    writer.add_text(f"{stage}/samples", table, self.global_step)

    def on_test_epoch_end(self) -> None:
        self.finish_evaluation("test")
        if self.decoding.test_output:
            outputs = self.gather(self.outputs)  # a collective: every rank joins
            if self.trainer.is_global_zero:
                write_lines(self.decoding.test_output, [o.text for o in outputs])

    # ------------------------------------------------------------------ predict
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[tuple[int, str]]:
        if batch.get("filler"):
            return []
        hp = self.decoding
        hypotheses = self.translate(batch["source"], batch["source_lengths"], hp.beam_size, hp.nbest)
        results = []
        for line, hyps in zip(batch["index"].tolist(), hypotheses):
            texts = [self.decode_text(h.tokens) for h in hyps]
            self.outputs.append(Generated(line, texts[0], source=" ||| ".join(f"{t} ||| {h.score:.4f}" for t, h in zip(texts, hyps))))
            results.append((line, texts[0]))
        return results

    def on_predict_epoch_end(self) -> None:
        outputs = self.gather(self.outputs)
        if self.decoding.predict_output and self.trainer.is_global_zero:
            write_lines(self.decoding.predict_output, [o.text for o in outputs])
            if self.decoding.nbest > 1:
                write_lines(self.decoding.predict_output + ".nbest", [f"{o.index} ||| {o.source}" for o in outputs])

    # ------------------------------------------------------------------ checkpoints
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("hyper_parameters", {}).get("source_vocab_size")
        if saved is not None and int(saved) != int(self.hparams.source_vocab_size):
            raise ValueError(
                f"checkpoint was trained with a source vocabulary of {saved} but the data gives "
                f"{self.hparams.source_vocab_size}: use the data and tokenizer settings it was trained with"
            )
        # The saved tokenizers must rebuild, as the kind the data is configured with: the attached
        # datamodule's (the command line's, app/checkpoint_io/policy.py), else, for a model restored
        # without its data, the checkpoint's own datamodule_hyper_parameters.
        state, where = checkpoint.get("datamodule_state"), self.checkpoint_name()
        datamodule = self.datamodule
        if isinstance(datamodule, TranslationDataModule):
            datamodule.load_state_for_checkpoint(state, where)  # encode inputs exactly as in training
            return
        configured = (checkpoint.get("datamodule_hyper_parameters") or {}).get("tokenizer")
        check_tokenizer_state(state, where, configured if isinstance(configured, str) else None, saved_setting=True)
        if datamodule is not None:
            datamodule.load_state_for_checkpoint(state, where)

