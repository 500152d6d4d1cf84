"""COCO caption metrics: same numbers as pycocoevalcap run directly, clean degradation without Java."""

from __future__ import annotations

import os
import warnings

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.rouge.rouge import Rouge

from tasks.caption_metrics import PACKAGE_DIR, CaptionScorer, java_available, simple_tokenize

# Captions with capitals and punctuation, so tokenisation matters.
REFERENCES = {
    1: ["A man riding a horse on a beach.", "A person rides a brown horse, near the sea.", "Man on horseback at the beach"],
    2: ["Two dogs play with a ball in the grass.", "Two dogs are playing in a field!", "A pair of dogs chasing a ball"],
    3: ["A plate of food with broccoli and rice.", "Rice, broccoli and meat on a white plate.", "A dinner plate with vegetables"],
}
PREDICTIONS = {1: "a man riding a horse on the beach", 2: "two dogs playing with a ball in a field", 3: "a plate of rice and broccoli"}

needs_java = pytest.mark.skipif(not java_available(), reason="java is not installed on this machine")


def files_under(path) -> set[str]:
    return {os.path.join(root, name) for root, _, names in os.walk(path) for name in names if not name.endswith(".pyc")}


def coco_reference_scores(with_meteor: bool) -> dict[str, float]:
    """pycocoevalcap exactly as the COCO evaluation script calls it."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": c} for c in refs] for i, refs in REFERENCES.items()})
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in PREDICTIONS.items()})
    expected = dict(zip(["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4"], Bleu(4).compute_score(gts, res, verbose=0)[0]))
    if with_meteor:
        from pycocoevalcap.meteor.meteor import Meteor

        expected["METEOR"] = Meteor().compute_score(gts, res)[0]
    expected["ROUGE-L"] = Rouge().compute_score(gts, res)[0]
    expected["CIDEr-D"] = Cider().compute_score(gts, res)[0]
    return expected


def check_equal_to_coco(tmp_path, with_meteor: bool) -> None:
    expected = coco_reference_scores(with_meteor)
    before = files_under(PACKAGE_DIR)
    ours = CaptionScorer(meteor=with_meteor, temp_dir=str(tmp_path)).score(REFERENCES, PREDICTIONS)
    assert files_under(PACKAGE_DIR) == before, "scorer left files inside the installed pycocoevalcap package"
    assert list(tmp_path.iterdir()) == [], "scorer did not clean up its temporary directory"
    assert set(ours) == set(expected)
    for name, value in expected.items():
        assert ours[name] == pytest.approx(value, abs=1e-9), f"{name}: ours {ours[name]} vs pycocoevalcap {value}"
    assert 0 < ours["BLEU-4"] < ours["BLEU-1"] < 1 and ours["CIDEr-D"] > 0.5


@needs_java
def test_scores_equal_pycocoevalcap_run_directly(tmp_path):
    check_equal_to_coco(tmp_path, with_meteor=False)


@needs_java
@pytest.mark.slow  # METEOR's JVM loads its paraphrase table: about 10 s per call on a busy machine
def test_scores_with_meteor_equal_pycocoevalcap_run_directly(tmp_path):
    check_equal_to_coco(tmp_path, with_meteor=True)


@needs_java
def test_simple_tokenizer_agrees_with_ptb_on_plain_captions():
    from tasks.caption_metrics import ptb_tokenize
    import tempfile

    captions = [c for refs in REFERENCES.values() for c in refs]
    with tempfile.TemporaryDirectory() as temp_dir:
        assert ptb_tokenize(captions, temp_dir) == [simple_tokenize(c) for c in captions]


def test_without_java_meteor_is_skipped_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH on which no java can be found
    assert not java_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scorer = CaptionScorer()
        scores = scorer.score(REFERENCES, PREDICTIONS)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "java not found" in messages[0] and "\n" not in messages[0]
    assert "METEOR" not in scores and "METEOR" not in scorer.metric_names
    # The remaining metrics are pycocoevalcap's on the simple tokenizer's output.
    gts = {i: [simple_tokenize(c) for c in refs] for i, refs in REFERENCES.items()}
    res = {i: [simple_tokenize(c)] for i, c in PREDICTIONS.items()}
    assert scores["BLEU-4"] == pytest.approx(Bleu(4).compute_score(gts, res, verbose=0)[0][3], abs=1e-12)
    assert scores["ROUGE-L"] == pytest.approx(Rouge().compute_score(gts, res)[0], abs=1e-12)
    assert scores["CIDEr-D"] == pytest.approx(Cider().compute_score(gts, res)[0], abs=1e-12)


def test_without_java_explicit_ptb_and_spice_refuse(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="PTB tokenizer needs java"):
        CaptionScorer(tokenizer="ptb")
    with pytest.raises(ValueError, match="SPICE needs java"):
        CaptionScorer(spice=True)


def test_simple_tokenizer_drops_punctuation_and_lowercases():
    assert simple_tokenize("A man, riding a Horse... on the beach!") == "a man riding a horse on the beach"
    assert simple_tokenize("Two dogs\nplay.") == "two dogs play"


def test_perfect_captions_score_high_and_bad_input_is_refused():
    references = {i: refs for i, refs in REFERENCES.items()}
    exact = {i: refs[0] for i, refs in references.items()}
    scores = CaptionScorer(tokenizer="simple", meteor=False).score(references, exact)
    assert scores["BLEU-1"] == pytest.approx(1.0, abs=1e-6)
    assert scores["CIDEr-D"] > CaptionScorer(tokenizer="simple", meteor=False).score(references, PREDICTIONS)["CIDEr-D"]
    with pytest.raises(ValueError, match="no reference captions for image id 9"):
        CaptionScorer(tokenizer="simple", meteor=False).score(references, {9: "a dog"})
    with pytest.raises(ValueError, match="unknown caption tokenizer 'nltk'"):
        CaptionScorer(tokenizer="nltk")
