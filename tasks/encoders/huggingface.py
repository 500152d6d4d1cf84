"""A Hugging Face ``transformers`` model as a language model encoder, so any head sits on a
(pretrained) Transformer: token ids ``(B, T)`` to the model's last hidden states ``(B, T, H)``.

    model:
      init_args:
        encoder:
          class_path: tasks.encoders.HuggingFaceEncoder
          init_args: {model: gpt2}          # a hub name, or a directory written by save_pretrained

Needs the optional ``transformers`` package (``pip install -e '.[hf]'``). docs/library.md has the usage.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch
from torch import Tensor

from datamodules.files import RefusedInput
from tasks.encoders.lm import LMEncoder

SETTING = "model.init_args.encoder.init_args"


def is_local_path(name: str) -> bool:
    """A directory the user means (absolute, relative with ``./`` or ``../``, ``~``, or existing),
    as opposed to a hub name such as ``gpt2`` or ``org/model``."""
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(name)


class HuggingFaceEncoder(LMEncoder):
    """The backbone of a ``transformers`` causal LM (GPT-2, Llama, ...) or of a masked LM loaded as
    a decoder (BERT-like models that take ``is_decoder``), built with ``AutoConfig`` / ``AutoModel``.

    Each TBPTT window is encoded on its own (no state crosses windows), at most ``max_length``
    tokens (the model's positions). The data's token ids are the model's input ids: with a
    vocabulary other than the model's tokenizer the input embedding is resized to ``vocab_size``
    (``resize_token_embeddings``) and only the layers above it carry pretrained knowledge.

    Args:
        vocab_size: number of input tokens (given by the task: the data's vocabulary size).
        model: a directory written by ``save_pretrained`` or a hub name (needs network access or
            the hub cache).
        pretrained: load the saved weights (``from_pretrained``); ``False`` builds the same
            architecture from its config with random weights.
        config_overrides: config fields to change before the model is built (dropout rates such as
            ``resid_pdrop``, ``num_hidden_layers``...).
        revision: hub revision (branch, tag or commit) of a hub name.

    Weights are read by ``transformers`` (safetensors, or ``torch.load`` with ``weights_only``); no
    code from the model's files is run (``trust_remote_code`` is never set).
    """

    #: What is loaded and from where (a hub name or directory, its revision): the command line's
    #: choice, never a checkpoint's (:mod:`app.checkpoint_io.policy`).
    runtime_options = ("model", "revision", "pretrained")

    def __init__(
        self,
        vocab_size: int,
        model: str | None = None,
        pretrained: bool = True,
        config_overrides: dict[str, Any] | None = None,
        revision: str | None = None,
    ) -> None:
        super().__init__()
        private = [key for key in (config_overrides or {}) if str(key).startswith("_")]
        if private:  # e.g. _attn_implementation, which can name hub code to download and run
            raise ValueError(f"HuggingFaceEncoder config_overrides may set the model's public config fields only, got "
                             f"{private[0]!r} (set {SETTING}.config_overrides)")
        if model is None:
            raise ValueError(
                f"HuggingFaceEncoder needs model: a directory written by save_pretrained or a hub name (set {SETTING}.model; "
                f"a checkpoint never chooses what is downloaded, so give it also when evaluating a checkpoint)"
            )
        try:
            import transformers
        except ImportError:
            raise ValueError(
                "HuggingFaceEncoder needs the transformers package, which is not installed: pip install -e '.[hf]' "
                "(or pip install transformers), or choose another model.init_args.encoder"
            ) from None
        if is_local_path(str(model)) and not os.path.isdir(os.path.expanduser(str(model))):
            raise ValueError(
                f"HuggingFaceEncoder model directory {model!r} does not exist: give a directory written by "
                f"save_pretrained or a hub name (set {SETTING}.model)"
            )
        source = os.path.expanduser(str(model)) if is_local_path(str(model)) else str(model)
        options = {"revision": revision} if revision else {}
        try:
            config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=False, **options)
            if getattr(config, "is_encoder_decoder", False):
                raise ValueError(f"is an encoder-decoder model ({type(config).__name__})")
            for key, value in (config_overrides or {}).items():
                if not hasattr(config, key):
                    raise ValueError(f"its config has no field {key!r} to override (set {SETTING}.config_overrides)")
                setattr(config, key, value)
            config.is_decoder = True  # a masked LM's layers with causal self-attention (BERT-like); causal LMs ignore it
            if pretrained:
                network = transformers.AutoModel.from_pretrained(source, config=config, dtype=torch.float32,
                                                                 trust_remote_code=False, **options)
            else:
                network = transformers.AutoModel.from_config(config, dtype=torch.float32, trust_remote_code=False)
        except pickle.UnpicklingError as error:
            # torch.load(weights_only=True) stopped at a global the weights file asks to import
            # (a __reduce__ payload): nothing was run, and the answer is never weights_only=False.
            asked = re.search(r"GLOBAL ([\w.]+)", str(error))
            what = f"ask to import {asked.group(1)}" if asked else "hold objects other than tensors"
            raise RefusedInput(
                f"HuggingFaceEncoder refused the weights of {model!r}: its pickled weights (pytorch_model*.bin) {what}, "
                f"and weights may hold only tensors, numbers, strings and containers (nothing was run; use a model saved "
                f"as safetensors by save_pretrained, or another model; set {SETTING}.model)"
            ) from None
        except (OSError, ValueError, KeyError) as error:
            reason = " ".join(str(error).split())[:300]
            raise ValueError(
                f"HuggingFaceEncoder cannot load {model!r}: {reason} (give a causal or masked LM as a directory written by "
                f"save_pretrained or a reachable hub name; set {SETTING}.model)"
            ) from None
        self.network = network.train()  # from_pretrained returns eval mode; the trainer switches modes from here
        if network.get_input_embeddings().num_embeddings != vocab_size:
            network.resize_token_embeddings(vocab_size, mean_resizing=False)  # the data's ids are the input ids
        self.embedding = network.get_input_embeddings()
        self.out_features = int(config.hidden_size)
        self.max_length = getattr(config, "max_position_embeddings", None)
        self.model_name = str(model)
        self._check_causal(vocab_size)

    def forward(self, tokens: Tensor, state: None = None) -> tuple[Tensor, Tensor, None]:
        """Shape: tokens ``(B, T)`` -> last hidden states ``(B, T, H)``, the same, ``None``."""
        B, T = tokens.shape
        if self.max_length is not None and T > self.max_length:
            raise ValueError(
                f"window of {T} tokens exceeds {self.model_name}'s {self.max_length} positions "
                f"(lower data.init_args.bptt)"
            )
        hidden = self.network(input_ids=tokens, use_cache=False).last_hidden_state  # (B, T, H)
        return hidden, hidden, None

    @torch.no_grad()
    def _check_causal(self, vocab_size: int) -> None:
        """Refuse a model whose position t sees later tokens: a language model scoring token t + 1
        from such hidden states would read its own target."""
        training = self.network.training
        self.network.eval()
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab_size, (1, 4), generator=generator)
        changed = tokens.clone()
        changed[0, -1] = (tokens[0, -1] + 1) % vocab_size
        first = self.forward(tokens)[0][0, :-1]
        second = self.forward(changed)[0][0, :-1]
        self.network.train(training)
        if not torch.allclose(first, second, atol=1e-5):
            raise ValueError(
                f"HuggingFaceEncoder model {self.model_name!r} is not causal (earlier positions change with a later "
                f"token): a language model needs a causal LM or a masked LM that runs as a decoder (set {SETTING}.model)"
            )

