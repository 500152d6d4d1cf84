"""COCO caption metrics, offline: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D (and SPICE on request).

Scores come from ``pycocoevalcap`` (the COCO caption evaluation code) on captions tokenised
the way COCO does it: Stanford's PTB tokenizer, lower-cased, punctuation removed
(Chen et al. 2015, "Microsoft COCO Captions: Data Collection and Evaluation Server", §3).
``pycocoevalcap``'s ``Cider`` is the CIDEr-D variant the COCO server reports (clipped n-gram
counts and the Gaussian length penalty, sigma = 6; Vedantam et al. 2015, §4.3).

Three things differ from calling ``pycocoevalcap`` naively, all on purpose:

* **Java.** The PTB tokenizer and METEOR are Java programs. Without ``java`` on ``PATH``
  METEOR is skipped and captions are split by :func:`simple_tokenize` instead (lower-case,
  punctuation split off and dropped with the PTB wrapper's own punctuation list), with one
  warning. BLEU/ROUGE-L/CIDEr-D then usually differ from the server's in the last digits,
  where contractions and hyphens are split differently.
* **Temporary files** go to a fresh temporary directory, never into the installed package
  (the stock PTB wrapper and SPICE write next to their jars, which fails on read-only
  installs and races between concurrent runs).
* **SPICE** is opt-in: it needs Java and Stanford CoreNLP 3.6.0, which ``pycocoevalcap``
  downloads on first use. When that is impossible the scorer refuses at construction with
  an error saying what is missing, instead of failing after a training epoch.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Hashable, Mapping, Sequence

import pycocoevalcap
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PUNCTUATIONS, STANFORD_CORENLP_3_4_1_JAR

#: Metric names as logged (``val/CIDEr-D``...), in COCO's reporting order.
METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D")
TOKENIZERS = ("auto", "ptb", "simple")

PACKAGE_DIR = Path(list(pycocoevalcap.__path__)[0])
PTB_JAR = PACKAGE_DIR / "tokenizer" / STANFORD_CORENLP_3_4_1_JAR
SPICE_JAR = PACKAGE_DIR / "spice" / "spice-1.0.jar"
SPICE_CORENLP_JAR = PACKAGE_DIR / "spice" / "lib" / "stanford-corenlp-3.6.0.jar"


def java_available() -> bool:
    """True when a ``java`` executable is on ``PATH`` (what every scorer subprocess runs)."""
    return shutil.which("java") is not None


def simple_tokenize(caption: str) -> str:
    """Java-free stand-in for the PTB tokenizer: lower-case, split punctuation off words,
    drop the punctuation tokens the COCO wrapper drops. Returns space-joined tokens."""
    spaced = re.sub(r"([^\w\s'])", r" \1 ", caption.lower().replace("\n", " "))
    return " ".join(token for token in spaced.split() if token not in PUNCTUATIONS)


def ptb_tokenize(captions: Sequence[str], temp_dir: str) -> list[str]:
    """Tokenise like ``pycocoevalcap.tokenizer.PTBTokenizer`` (same jar, flags and
    punctuation filter), one output per input, with the input file in ``temp_dir``."""
    if not captions:
        return []
    fd, path = tempfile.mkstemp(dir=temp_dir, prefix="ptb-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write("\n".join(c.replace("\n", " ") for c in captions))
    command = ["java", "-cp", str(PTB_JAR), "edu.stanford.nlp.process.PTBTokenizer", "-preserveLines", "-lowerCase", path]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"PTB tokenizer failed (exit {result.returncode}): {result.stderr.decode(errors='replace').strip()[:300]}")
    lines = result.stdout.decode("utf-8").split("\n")
    return [" ".join(w for w in line.rstrip().split(" ") if w not in PUNCTUATIONS) for line in lines[: len(captions)]]


class CaptionScorer:
    """Corpus-level COCO caption metrics for one set of predictions.

    Args:
        tokenizer: ``ptb`` (needs Java), ``simple`` (:func:`simple_tokenize`) or ``auto``
            (PTB when Java is available, else simple with a warning).
        meteor: compute METEOR when Java is available (skipped with a warning otherwise).
        spice: also compute SPICE (needs Java and Stanford CoreNLP; checked here).
        temp_dir: parent directory of the scorer's temporary files (default: the system's).

    Example::

        scores = CaptionScorer().score({1: ["a dog runs", "a dog is running"]}, {1: "a dog runs"})
        scores["CIDEr-D"], scores["BLEU-4"]
    """

    def __init__(self, tokenizer: str = "auto", meteor: bool = True, spice: bool = False, temp_dir: str | None = None) -> None:
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown caption tokenizer {tokenizer!r}: valid are {', '.join(TOKENIZERS)} (set model.init_args.metric_tokenizer)")
        has_java = java_available()
        if tokenizer == "ptb" and not has_java:
            raise ValueError("the PTB tokenizer needs java on PATH, which was not found (install a Java runtime or set model.init_args.metric_tokenizer: simple)")
        if spice:
            check_spice_available()
        self.use_ptb = tokenizer == "ptb" or (tokenizer == "auto" and has_java)
        self.use_meteor = meteor and has_java
        self.spice = spice
        self.temp_dir = temp_dir
        skipped = [what for what, wanted in (("METEOR", meteor), ("the PTB tokenizer", tokenizer == "auto")) if wanted and not has_java]
        if skipped:
            warnings.warn(
                f"java not found on PATH: skipping {' and '.join(skipped)} (captions split by the simple "
                f"tokenizer; install a Java runtime for COCO-exact scores)",
                stacklevel=2,
            )

    @property
    def metric_names(self) -> list[str]:
        names = [m for m in METRICS if m != "METEOR" or self.use_meteor]
        return names + (["SPICE"] if self.spice else [])

    def tokenize(self, references: Mapping[Hashable, Sequence[str]], predictions: Mapping[Hashable, str], temp_dir: str) -> tuple[dict, dict]:
        """Tokenise every caption in one tokenizer call; returns ``(gts, res)`` in the
        ``{image_id: [tokenised caption, ...]}`` layout the pycocoevalcap scorers take."""
        ids = list(predictions)
        flat = [predictions[i] for i in ids]
        owners: list[Hashable] = [None] * len(ids)
        for i in ids:
            flat.extend(references[i])
            owners.extend([i] * len(references[i]))
        tokens = ptb_tokenize(flat, temp_dir) if self.use_ptb else [simple_tokenize(c) for c in flat]
        res = {i: [tokens[k]] for k, i in enumerate(ids)}
        gts: dict[Hashable, list[str]] = {i: [] for i in ids}
        for owner, caption in zip(owners[len(ids):], tokens[len(ids):]):
            gts[owner].append(caption)
        return gts, res

    def score(self, references: Mapping[Hashable, Sequence[str]], predictions: Mapping[Hashable, str]) -> dict[str, float]:
        """Corpus scores of ``predictions`` (one caption per image id) against
        ``references`` (every reference caption of each predicted image id).

        CIDEr-D's document frequencies come from the references of the scored images, as on
        the COCO server, so scores of a subset are not comparable with those of a full split.
        """
        if not predictions:
            return {}
        missing = [i for i in predictions if not references.get(i)]
        if missing:
            raise ValueError(f"no reference captions for image id {missing[0]!r} ({len(missing)} predicted ids lack references)")
        with tempfile.TemporaryDirectory(prefix="caption-metrics-", dir=self.temp_dir) as temp_dir:
            gts, res = self.tokenize(references, predictions, temp_dir)
            scores: dict[str, float] = {}
            bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
            scores.update({f"BLEU-{n + 1}": float(b) for n, b in enumerate(bleu)})
            if self.use_meteor:
                from pycocoevalcap.meteor.meteor import Meteor

                scores["METEOR"] = float(Meteor().compute_score(gts, res)[0])
            scores["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
            scores["CIDEr-D"] = float(Cider().compute_score(gts, res)[0])
            if self.spice:
                scores["SPICE"] = spice_score(gts, res, temp_dir)
        return scores


def check_spice_available() -> None:
    """Raise a one-line ``ValueError`` unless SPICE can run: Java plus Stanford CoreNLP 3.6.0
    (downloaded by pycocoevalcap on first use when missing)."""
    if not java_available():
        raise ValueError("SPICE needs java on PATH, which was not found (install a Java runtime or set model.init_args.spice: false)")
    if SPICE_CORENLP_JAR.exists():
        return
    from pycocoevalcap.spice.get_stanford_models import get_stanford_models

    try:
        get_stanford_models()
    except Exception as error:  # network, disk or zip errors all mean the same to the user
        raise ValueError(
            f"SPICE needs Stanford CoreNLP 3.6.0 at {SPICE_CORENLP_JAR} and downloading it failed "
            f"({type(error).__name__}: {error}); place stanford-corenlp-3.6.0.jar and "
            f"stanford-corenlp-3.6.0-models.jar there by hand or set model.init_args.spice: false"
        ) from None


def spice_score(gts: Mapping[Hashable, Sequence[str]], res: Mapping[Hashable, Sequence[str]], temp_dir: str) -> float:
    """Mean SPICE F-score, running the SPICE jar with its input, output and cache in
    ``temp_dir`` (pycocoevalcap's wrapper writes them into the installed package)."""
    items = [{"image_id": i, "test": res[i][0], "refs": list(gts[i])} for i in res]
    in_path, out_path = os.path.join(temp_dir, "spice-in.json"), os.path.join(temp_dir, "spice-out.json")
    with open(in_path, "w", encoding="utf-8") as handle:
        json.dump(items, handle)
    command = ["java", "-jar", "-Xmx8G", str(SPICE_JAR), in_path, "-cache", os.path.join(temp_dir, "spice-cache"), "-out", out_path, "-subset", "-silent"]
    subprocess.run(command, check=True, cwd=str(SPICE_JAR.parent))
    with open(out_path, encoding="utf-8") as handle:
        results = json.load(handle)
    values = [float(r["scores"]["All"]["f"]) for r in results if r["scores"]["All"]["f"] is not None]
    return sum(values) / len(values) if values else math.nan
