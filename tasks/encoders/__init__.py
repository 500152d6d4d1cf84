"""The networks a task is given by ``class_path`` (``model.init_args.encoder``), sizes linked from data.

Language model encoders take the vocabulary size from the task (:class:`tasks.encoders.lm.LMEncoder`);
classification encoders map ``batch["input"]`` to ``(B, out_features)``; translation networks
(:class:`tasks.encoders.seq2seq.Seq2SeqNetwork`) take both vocabulary sizes; the captioning decoder takes
the caption vocabulary size and the image encoder's channels.
"""

from tasks.encoders.awd_lstm import AWDLSTMEncoder
from tasks.encoders.hanzi_cnn import HanziCNN, ResNet18Encoder
from tasks.encoders.huggingface import HuggingFaceEncoder
from tasks.encoders.lm import LMEncoder
from tasks.encoders.mlp import MLPEncoder
from tasks.encoders.resnet import ResNetEncoder
from tasks.encoders.seq2seq import LuongAttentionSeq2Seq, Seq2SeqNetwork
from tasks.encoders.show_tell import ShowTellDecoder
from tasks.encoders.transformer_lm import TransformerLMEncoder
from tasks.encoders.transformer_seq2seq import TransformerSeq2Seq

__all__ = ["AWDLSTMEncoder", "HanziCNN", "HuggingFaceEncoder", "LMEncoder", "LuongAttentionSeq2Seq", "MLPEncoder", "ResNet18Encoder", "ResNetEncoder",
           "Seq2SeqNetwork", "ShowTellDecoder", "TransformerLMEncoder", "TransformerSeq2Seq"]
