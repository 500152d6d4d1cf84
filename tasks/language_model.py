"""Word-level language modeling with truncated BPTT and any output head."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Literal, Sequence

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from datamodules.base import TokenWindows
from datamodules.files import check_output_file, write_atomically
from heads.export import check_export_arguments
from tasks.base import IGNORE_INDEX, HeadSpec, HeadTask, build_head, global_mean_count
from tasks.encoders import AWDLSTMEncoder, LMEncoder
from tasks.encoders.lm import component_config, encoder_factory
from tasks.metrics import TokenMetrics

RUNTIME_OPTIONS = ("predict_mode", "num_samples", "sample_length", "temperature", "predict_output", "compile")

#: A language model's encoder: called with the vocabulary size (``class_path`` + ``init_args`` in configs).
EncoderSpec = Callable[[int], LMEncoder]


def detach_state(state: Any) -> Any:
    """Cut the autograd graph at a window boundary but keep the values (TBPTT)."""
    if state is None:
        return None
    if isinstance(state, Tensor):
        return state.detach()
    return type(state)(detach_state(s) for s in state)


def check_sampling_settings(temperature: float, num_samples: int, sample_length: int) -> None:
    """Refuse, in one line, sampling settings that would sample from the wrong distribution or
    fail mid-predict: ``temperature`` divides the log-probabilities, so 0 is a division by zero
    (torch's multinomial then fails on inf/nan) and a negative one silently inverts the
    distribution (the least likely words become the most likely)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(
            f"LanguageModel needs temperature > 0 (finite), got {temperature} (it divides the log-probabilities: "
            f"below 1 sharpens, above 1 flattens; set model.init_args.temperature, e.g. 1.0)"
        )
    for key, value in (("num_samples", num_samples), ("sample_length", sample_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"LanguageModel needs {key} >= 1, got {value} (set model.init_args.{key})")


class LanguageModel(HeadTask):
    """A language model of any encoder (AWD-LSTM, Transformer) whose output layer is any head.

    Truncated BPTT: batches are consecutive windows of ``B`` contiguous streams (see
    :mod:`datamodules.lm_stream`); the recurrent state is carried from one window to the
    next and detached, and reset at the start of every epoch and evaluation. Lightning 2
    removed its built-in TBPTT, so the task does it here. A checkpoint written mid-epoch
    carries the training state of every rank (and the RNG state), and a resumed run puts it
    back before the next window, so kill-and-resume gives the uninterrupted run's result
    (docs/reliability.md, "Resume"). With the data's random window
    lengths, the learning rate of each step is scaled by ``T / bptt`` (AWD-LSTM §4.1) so
    short windows do not get the same step size as long ones.

    Args:
        num_classes: vocabulary size (linked from the datamodule by the CLI).
        encoder: the network, ``class_path`` + ``init_args`` of an
            :class:`tasks.encoders.LMEncoder` (``tasks.encoders.AWDLSTMEncoder``,
            ``tasks.encoders.TransformerLMEncoder``); the task passes it the vocabulary size, and
            its ``out_features`` is the head's ``in_features``.
        head: output head as a short name or a ``class_path`` factory.
        tie_weights: share the encoder's input embedding with the head's class embeddings.
        unigram_bias_init: start the head's class biases at the training unigram (log
            frequencies) when fitting from scratch; without it, heads behind a narrow ``tanh``
            latent layer can sit at the unigram perplexity for thousands of steps (docs/lm.md).
        rescale_lr_by_length: scale each step's learning rate by ``T / bptt``.
        activation_regularization: AR weight α on the dropped output (AWD-LSTM §4.6).
        temporal_activation_regularization: TAR weight β on the raw output's change.
        eval_topk: top-k next-token accuracies computed in evaluation.
        predict_mode: ``"score"`` the predict split or ``"sample"`` text from the model.
        num_samples, sample_length: ``predict_mode sample`` draws ``num_samples`` lines of
            ``sample_length`` words (each >= 1).
        temperature: ``predict_mode sample`` divides the log-probabilities by it (> 0: below 1
            sharpens the distribution, above 1 flattens it).
        predict_output: file the predictions are written to (atomically).
        compile: ``torch.compile`` the encoder and the head at setup: ``true``, or a mapping of
            torch.compile options (``{mode: max-autotune}``); a run-time choice, not saved with the
            checkpoint (docs/benchmarks.md, "torch.compile").
    """

    compiled_modules = ("encoder", "head")
    runtime_options = RUNTIME_OPTIONS
    #: HPARAMS metrics: perplexity and the top-k accuracies of the default ``eval_topk``.
    hparams_metrics = ("ppl", "acc@1", "acc@5", "acc@10")

    def __init__(
        self,
        num_classes: int,
        encoder: EncoderSpec = AWDLSTMEncoder,
        head: HeadSpec = "softmax",
        tie_weights: bool = True,
        unigram_bias_init: bool = True,
        rescale_lr_by_length: bool = True,
        activation_regularization: float = 0.0,
        temporal_activation_regularization: float = 0.0,
        eval_topk: Sequence[int] = (1, 5, 10),
        predict_mode: Literal["score", "sample"] = "score",
        num_samples: int = 5,
        sample_length: int = 30,
        temperature: float = 1.0,
        predict_output: str | None = None,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: LRSchedulerCallable | None = None,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__(optimizer=optimizer, lr_scheduler=lr_scheduler, monitor="val/loss", compile=compile)
        # Runtime options stay out of the hyper-parameters: with --ckpt_path, LightningCLI
        # re-applies a checkpoint's hyper-parameters over the command line, which would
        # silently replace e.g. the user's predict_output with the training run's value.
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", *self.runtime_options])
        # An encoder passed from Python is kept as class_path + init_args where it can be (a class,
        # a functools.partial of one), so the checkpoint rebuilds it. Other built objects are not
        # configuration: dropped, so checkpoints stay loadable with weights_only; pass them again
        # to load_from_checkpoint. Through the CLI both are class_path/init_args dicts already.
        for key, config in (("encoder", component_config(self.hparams.get("encoder"))), ("head", self.hparams.get("head"))):
            if isinstance(config, (str, dict)):
                self.hparams[key] = config
            else:
                self.hparams.pop(key, None)
        self.predict_mode, self.num_samples, self.sample_length = predict_mode, num_samples, sample_length
        check_output_file(predict_output, "model.init_args.predict_output")
        check_sampling_settings(temperature, num_samples, sample_length)
        self.temperature, self.predict_output = temperature, predict_output
        if any(not 1 <= int(k) <= num_classes for k in eval_topk):  # else torch's topk fails at the first validation
            raise ValueError(
                f"LanguageModel needs eval_topk in 1..num_classes={num_classes}, got {list(eval_topk)} "
                f"(set model.init_args.eval_topk to values up to {num_classes})"
            )
        self.encoder = encoder_factory(encoder)(num_classes)
        if not isinstance(self.encoder, LMEncoder):
            raise ValueError(
                f"LanguageModel needs an encoder built on tasks.encoders.LMEncoder, got {type(self.encoder).__name__} "
                f"(set model.init_args.encoder.class_path, e.g. tasks.encoders.AWDLSTMEncoder)"
            )
        self.head = build_head(head, self.encoder.out_features, num_classes)
        # A head over code sequences (heads.lightrnn.HybridLightRNNCodes, seed 002 Eq. 4): the
        # network reads the head's codes, so it embeds the code dictionary instead of the words.
        self.code_inputs = bool(getattr(self.head, "code_inputs", False))
        if self.code_inputs:
            self.encoder = encoder_factory(encoder)(self.head.num_input_codes)
        self.unigram_bias_init = unigram_bias_init
        if tie_weights:
            self.head.tie_to(self.encoder.embedding)
        self.train_metrics = TokenMetrics(topk=())
        # A word's top-k under code inputs needs a network step per row: not computed.
        self.val_metrics = TokenMetrics(topk=() if self.code_inputs else eval_topk)
        self.test_metrics = TokenMetrics(topk=() if self.code_inputs else eval_topk)
        self.predict_metrics = TokenMetrics(topk=())  # predict_mode score
        self._state: dict[str, Any] = {}
        self._train_position = (0, 0)  # (epoch, windows trained on) of the carried train state
        self._resume_state: dict[str, Any] | None = None
        self._length_ratio = 1.0
        self._predictions: list[Any] = []

    # ------------------------------------------------------------------ model
    def encode(self, tokens: Tensor, state: Any = None) -> tuple[Tensor, Tensor, Any]:
        """Shape: tokens ``(B, T)`` -> hidden ``(B, T, H)``, raw ``(B, T, H)``, new state."""
        return self.encoder(tokens, state)

    def head_input(self, batch: dict[str, Tensor]) -> Tensor:
        """Hidden states of one batch from a fresh recurrent state. Shape ``(B, T, H)``."""
        hidden, _, _ = self.encode(self._network_input(batch))
        return hidden

    def _network_input(self, batch: dict[str, Tensor]) -> Tensor:
        """What the network reads: the words ``(B, T)``, or the head's code sequence ``(B, 2T)``."""
        if self.code_inputs:
            return self.head.code_sequence(batch["input"], batch["target"])
        return batch["input"]

    def _step(self, batch: dict[str, Tensor], stage: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        hidden, raw, state = self.encode(self._network_input(batch), self._state.get(stage))
        self._state[stage] = detach_state(state)
        target = batch["target"]
        nll = self.head(hidden, target)  # (B, T)
        tokens = (target != IGNORE_INDEX).sum()
        # In training, the global mean token count (tasks/base.py): exact DDP steps also for the padded
        # last window, whose ranks hold different numbers of real targets.
        loss = nll.sum() / (global_mean_count(tokens) if stage == "train" else tokens.clamp_min(1))
        return loss, nll, hidden, raw

    # ------------------------------------------------------------------ train
    def on_train_epoch_start(self) -> None:
        self._state.pop("train", None)

    def on_train_batch_start(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self._resume_state is not None:
            self._restore_train_state(batch_idx, batch["input"].shape[0])
        self._train_position = (self.current_epoch, batch_idx + 1)
        datamodule = self.datamodule
        bptt = datamodule.bptt if isinstance(datamodule, TokenWindows) else batch["input"].shape[1]
        self._length_ratio = batch["input"].shape[1] / bptt

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, nll, hidden, raw = self._step(batch, "train")
        total = loss
        alpha, beta = self.hparams.activation_regularization, self.hparams.temporal_activation_regularization
        if alpha:
            total = total + alpha * hidden.pow(2).mean()
        if beta and raw.shape[1] > 1:
            total = total + beta * (raw[:, 1:] - raw[:, :-1]).pow(2).mean()
        total = self.add_head_regularization(total)
        self.train_metrics.update(nll, batch["target"])
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=False, prog_bar=True, sync_dist=True)  # rank mean = global per-token mean
        self.log_head_stats("train")
        return total

    def on_train_epoch_end(self) -> None:
        metrics = self.train_metrics.compute()
        self.log_reduced("train/ppl", metrics["ppl"])
        self.train_metrics.reset()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        ratio = self._length_ratio if self.hparams.rescale_lr_by_length else 1.0
        saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * ratio
        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:
            for group, lr in zip(optimizer.param_groups, saved):
                group["lr"] = lr

    # ------------------------------------------------------------------ evaluate
    def _eval_step(self, batch: dict[str, Tensor], stage: str, metrics: TokenMetrics) -> None:
        _, nll, hidden, _ = self._step(batch, stage)
        topk = self.head.topk(hidden, metrics.max_k)[1] if metrics.max_k else None
        metrics.update(nll, batch["target"], topk)

    def on_validation_epoch_start(self) -> None:
        self._state.pop("val", None)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val", self.val_metrics)

    def on_validation_epoch_end(self) -> None:
        metrics = self.val_metrics.compute()
        self.val_metrics.reset()
        for name, value in metrics.items():
            self.log_reduced(f"val/{name}", value, prog_bar=name == "ppl")
        self.log_hparams("val", metrics)

    def on_test_epoch_start(self) -> None:
        self._state.pop("test", None)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_metrics)

    def on_test_epoch_end(self) -> None:
        metrics = self.test_metrics.compute()
        self.test_metrics.reset()
        for name, value in metrics.items():
            self.log_reduced(f"test/{name}", value)
        self.log_hparams("test", metrics)
        true_entropy = None if self.datamodule is None else self.datamodule.true_entropy
        if true_entropy is not None:
            # How far the model is from the language's own perplexity (1.0 is perfect).
            self.log_reduced("test/true_ppl", math.exp(true_entropy))
            self.log_reduced("test/ppl_over_true", metrics["ppl"] / math.exp(true_entropy))

    # ------------------------------------------------------------------ predict
    def on_predict_epoch_start(self) -> None:
        self._state.pop("predict", None)
        self._predictions = []
        self.predict_metrics.reset()

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        """``score``: the batch's ``[summed NLL, tokens]``; ``sample``: the samples (drawn at the
        first batch; later batches add none). What the epoch writes is built in
        :meth:`on_predict_epoch_end`."""
        if self.predict_mode == "sample":
            if batch_idx == 0:
                self._predictions = self.sample(self.num_samples, self.sample_length)
                return list(self._predictions)
            return []
        _, nll, _, _ = self._step(batch, "predict")
        self.predict_metrics.update(nll, batch["target"])
        return torch.stack([nll.detach().sum().double(), (batch["target"] != IGNORE_INDEX).sum().double()])

    @torch.no_grad()
    def sample(self, num_samples: int, length: int) -> list[str]:
        """Ancestral sampling from sentence start, one line per sample."""
        if self.code_inputs:
            raise ValueError(
                f"predict_mode sample needs a word distribution per step, which {type(self.head).__name__} (code "
                f"inputs) does not give from one hidden state: use predict_mode score, or heads.HybridLightRNN"
            )
        # The words of the data or of the loaded checkpoint; ids (as text) for a model used alone.
        itos = self.class_names() or [str(i) for i in range(self.hparams.num_classes)]
        eos = itos.index("<eos>") if "<eos>" in itos else 0
        tokens = torch.full((num_samples, 1), eos, dtype=torch.long, device=self.device)
        generator = torch.Generator(device="cpu").manual_seed(0)
        state, window = None, tokens
        out: list[list[int]] = [[] for _ in range(num_samples)]
        for _ in range(length):
            if self.encoder.max_length is not None:  # stateless: the context is the last max_length tokens
                hidden, _, _ = self.encode(tokens[:, -self.encoder.max_length :])
            else:
                hidden, _, state = self.encode(window, state)
            log_probs = self.head.log_prob(hidden[:, -1]) / self.temperature  # (S, V)
            probs = torch.softmax(log_probs, dim=-1).cpu()
            window = torch.multinomial(probs, 1, generator=generator).to(self.device)  # (S, 1)
            tokens = torch.cat([tokens, window], dim=1)
            for i, token in enumerate(window.squeeze(1).tolist()):
                out[i].append(token)
        return [" ".join(itos[t] for t in row) for row in out]

    def on_predict_epoch_end(self) -> None:
        if self.predict_mode == "score":
            # The NLL sum (float64) and token count reduced over DDP ranks by torchmetrics (a
            # collective: every rank runs this hook), divided once.
            with self.predict_metrics.sync_context():
                nll, tokens = float(self.predict_metrics.nll_sum), int(self.predict_metrics.tokens)
            ppl = math.exp(nll / max(tokens, 1))
            lines = [f"tokens\t{tokens}", f"nll\t{nll / max(tokens, 1):.6f}", f"ppl\t{ppl:.4f}"]
        else:
            lines = list(self._predictions)
        if self.trainer.is_global_zero:
            text = "\n".join(lines) + "\n"
            print(text, end="")
            if self.predict_output:
                write_atomically(self.predict_output, text)

    # ------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        # Every rank runs this hook (Lightning dumps the checkpoint on all ranks, rank 0 writes
        # it), so the gather below is a collective that every rank joins.
        state = self._state.get("train")
        epoch, windows = self._train_position
        trainer = self._trainer
        windows_in_epoch = getattr(trainer, "num_training_batches", math.inf) if trainer is not None else math.inf
        checkpoint["tbptt"] = {
            "epoch": epoch,
            "windows_done": windows,
            # At the end of an epoch the resumed run starts the next epoch with a fresh LSTM state,
            # but it still needs this RNG state (dropout of the next epoch's first window).
            "epoch_complete": windows >= windows_in_epoch,
            "state": None if state is None else [tuple(self._gather_rows(t) for t in layer) for layer in state],
            "rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._resume_state = checkpoint.get("tbptt")

    def _gather_rows(self, tensor: Tensor) -> Tensor:
        """This rank's ``(layers, B, H)`` state -> the global ``(layers, world * B, H)`` rows,
        rank-major like the stream's global rows (datamodules/lm_stream.py)."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if world == 1:
            return tensor.detach().cpu()
        gathered = self.all_gather(tensor.detach())  # (W, layers, B, H)
        W, layers, B, H = gathered.shape
        return gathered.permute(1, 0, 2, 3).reshape(layers, W * B, H).cpu()  # (layers, W*B, H)

    def _restore_train_state(self, batch_idx: int, batch_rows: int) -> None:
        """On the first training window after a resume: put back the RNG state and the carried
        LSTM state if the checkpoint was written right before this window of this epoch.

        A checkpoint from the end of epoch ``e`` is followed by window 0 of epoch ``e + 1``:
        the uninterrupted run starts that epoch with a fresh LSTM state but with the RNG where
        epoch ``e`` (and its validation) left it, which is the saved RNG state, since neither
        validation nor the stream's loaders draw from the global RNG (``StreamLoader`` has its
        own generator) and evaluation runs without dropout."""
        saved, self._resume_state = self._resume_state, None
        here = (self.current_epoch, batch_idx)
        if saved.get("epoch_complete") and here == (saved["epoch"] + 1, 0):
            self._set_rng_state(saved)
            return
        if here != (saved["epoch"], saved["windows_done"]):
            return
        self._set_rng_state(saved)
        if saved["state"] is None:
            return
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self._trainer is not None else (0, 1)
        rows, B = saved["state"][0][0].shape[1], batch_rows
        if rows != world * B:
            raise ValueError(
                f"checkpoint carries TBPTT state for {rows} global rows but this run has {world} "
                f"process(es) x batch_size {B} = {world * B} (resume with devices * "
                f"data.init_args.batch_size = {rows})"
            )
        self._state["train"] = [
            tuple(t[:, rank * B : (rank + 1) * B].to(self.device) for t in layer) for layer in saved["state"]
        ]

    def _set_rng_state(self, saved: dict[str, Any]) -> None:
        torch.set_rng_state(saved["rng_state"])
        if saved.get("cuda_rng_state") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(saved["cuda_rng_state"], self.device)


class NextTokenInference(nn.Module):
    """A language model's next-token inference as one module, what ``python -m app convert export
    --part network`` traces: token ids and the encoder's state in, the head's ``log_prob`` or
    ``topk`` at every position and the new state out. The model is put in eval mode (no dropout).

    Args:
        model: a trained :class:`LanguageModel` whose head reads hidden states (not codes).
        method: ``"log_prob"`` or ``"topk"`` (:data:`heads.export.METHODS`).
        k: number of classes ``topk`` returns (ignored by ``log_prob``).

    Shape:
        tokens ``(B, T)`` and the encoder's ``state`` (AWD-LSTM: ``(h, c)`` of each layer, each
        ``(1, B, H_layer)``, zeros to start a stream; a stateless encoder takes none) ->
        ``log_prob``: ``log_probs (B, T, V)``; ``topk``: ``log_probs, indices``, each ``(B, T, k)``;
        then the new state (the same structure), unless the encoder is stateless.
    """

    def __init__(self, model: LanguageModel, method: str = "topk", k: int = 10) -> None:
        super().__init__()
        check_export_arguments(model.head, method, k)
        self.encoder, self.head = model.encoder.eval(), model.head.eval()
        self.method, self.k = method, k

    def forward(self, tokens: Tensor, state: Any = None) -> tuple[Any, ...]:
        hidden, _, state = self.encoder(tokens, state)  # (B, T, H)
        if self.method == "log_prob":
            answer = (self.head.log_prob(hidden),)  # (B, T, V)
        else:
            values, indices = self.head.topk(hidden, self.k)  # a plain tuple: torch.return_types do not serialise
            answer = (values, indices)  # each (B, T, k)
        return answer if state is None else (*answer, state)

    @torch.no_grad()
    def example_inputs(self, batch: int, window: int, seed: int = 0) -> tuple[Tensor, Any]:
        """Random token ids ``(batch, window)`` and the state after another random window (not
        zeros, so a program that ignored its state input would answer differently)."""
        generator = torch.Generator().manual_seed(seed)
        vocab = self.encoder.embedding.num_embeddings
        first, tokens = torch.randint(0, vocab, (2, batch, window), generator=generator)
        _, _, state = self.encoder(first, None)
        return tokens, state

    def dynamic_shapes(self, window: int) -> dict[str, Any]:
        """``torch.export`` sizes of the inputs: the batch free in the tokens and in every state
        tensor; the time free for a stateless encoder (up to its ``max_length``), fixed at
        ``window`` for a recurrent one (``torch.export`` unrolls ``nn.LSTM`` over the time steps)."""
        batch = torch.export.Dim("batch", min=1)
        stateless = self.encoder.max_length is not None
        tokens = {0: batch, 1: torch.export.Dim("time", min=1, max=self.encoder.max_length)} if stateless else {0: batch}
        # the state's batch dimension is the one that changes with the number of streams
        (_, narrow), (_, wide) = self.example_inputs(2, window), self.example_inputs(3, window)

        def batch_dims(a: Any, b: Any) -> Any:
            if isinstance(a, Tensor):
                return {next(i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n): batch}
            return None if a is None else type(a)(batch_dims(x, y) for x, y in zip(a, b))

        return {"tokens": tokens, "state": batch_dims(narrow, wide)}


def export_network(model: LanguageModel, method: str = "topk", k: int = 10, window: int = 1) -> torch.export.ExportedProgram:
    """:func:`torch.export.export` of :class:`NextTokenInference` on CPU: any number of streams;
    windows of ``window`` tokens for a recurrent encoder, of 1 to ``max_length`` for a stateless one."""
    module = NextTokenInference(model, method, k).float()
    stateless = module.encoder.max_length is not None
    trace_window = min(max(window, 2), module.encoder.max_length) if stateless else window  # a size of 1 would be fixed
    with torch.no_grad(), warnings.catch_warnings():
        # nn.LSTM re-lists its weights in _flat_weights on every call; they are its parameters and
        # the program holds them as such (the command compares its answers with the eager model's)
        warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights.* were assigned during export")
        return torch.export.export(module, module.example_inputs(2, trace_window), dynamic_shapes=module.dynamic_shapes(trace_window))
