"""Every command printed in README.md and docs/**/*.md runs, through a shell, at tiny size (slow).

The commands are the logical lines (``\\`` continuations joined, comments dropped) of every fenced
block tagged ``bash`` / ``sh`` / ``shell`` (``console``: the ``$ `` lines). Every fenced block must
name its language, so a command cannot hide in an untagged block. ``COMMANDS`` maps each
documented command that needs more than the default (its text, whitespace collapsed) to how it is
run. Without an entry, a ``pytest`` command is collected and a ``fit`` of a config in
``TINY_BY_CONFIG`` runs with that config's tiny sizes, so a new documented run of a shipped config
needs no entry; any other documented command without an entry, or an entry whose command left the
docs, fails ``test_every_documented_command_has_an_entry``.

How a command runs (``test_documented_command``): ``bash -c`` with the documented text, in a
scratch copy of the checkout layout (``configs``, ``examples``, ``.venv`` and ``../shared``
linked, so relative paths and ``.venv/bin/python`` mean what they mean at the repository root;
``python`` is the project's interpreter; one thread), with tiny sizes appended as ordinary
overrides (the last value of an option wins). A command that needs a checkpoint runs after the documented command that makes
it, in the same scratch directory, so a documented path such as
``runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt`` must be where that fit wrote; placeholders
(``PATH``, ``runs/.../last.ckpt``, ``<run>``, ``best-epoch=...``) are replaced by that checkpoint.
The files a command says it writes are checked. ``pytest`` commands are collected
(``--collect-only``) from the repository root: the tests they name run in the suite itself. The
README's install-and-run lines must match ``.ci/run``. A few commands cannot run here; ``Skip``
entries say why. The whole module is ``slow`` (CI's second phase).

The docs' other names are checked too: every project path and dotted module name they print
exists, and docs/README.md lists every page.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

from tests.test_captioning import write_karpathy_fixture
from tests.test_cli import PTB, write_corpus

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
SHARED_DATA = ROOT.parent / "shared" / "data"


# ------------------------------------------------------------------------------------ extraction
def fenced_blocks(page: Path) -> list[tuple[str, int, str]]:
    """``(language, line of the opening fence, body)`` of every fenced block of a Markdown page."""
    text = page.read_text(encoding="utf-8")
    return [(m.group(1).strip(), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)]


def logical_lines(body: str, language: str) -> list[tuple[int, str]]:
    """The commands of a shell block: ``(offset of the first line, text)``, continuation lines
    joined, comment lines and trailing comments dropped, whitespace collapsed."""
    commands: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for offset, raw in enumerate(body.splitlines(), 1):
        line = raw.strip()
        if not pending:
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            start = offset
        elif line.startswith("#"):
            continue
        line = re.sub(r"\s+#(\s.*)?$", "", line)
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        commands.append((start, " ".join(" ".join(pending).split())))
        pending = []
    assert not pending, f"a shell block ends inside a continued line: {pending}"
    return commands


#: A command printed inline in prose or a table (`` `python -m app bench ds --repeats 5` ``).
INLINE_COMMAND = re.compile(r"`((?:\w+=\S+ )*(?:\.venv/bin/)?python3? -[mc] [^`]+)`")
#: Marks of an inline command that is a summary or a pattern, not a line to run: an elided part,
#: a placeholder, a choice. Such a command's full form is printed in a fenced block nearby.
NOT_RUNNABLE = re.compile(r"\.\.\.|…|<|>|\bMODE\b|\bFILE\b|\bX\.ckpt\b|\||\[|\{")


def outside_fences(page: Path) -> list[str]:
    """The page's lines with every fenced block blanked (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8")).splitlines()


def inline_commands(page: Path) -> list[tuple[int, str]]:
    """``(line, command)`` of every complete command printed inline outside fenced blocks: one
    with arguments beyond the subcommand (``python -m app bench heads`` names a tool, not a run)
    and no placeholder."""
    found = []
    for number, line in enumerate(outside_fences(page), 1):
        for match in INLINE_COMMAND.finditer(line):
            command = " ".join(match.group(1).split())
            tool_name = re.fullmatch(r"(\w+=\S+ )*python3? -m app( \w+){0,2}", command)
            if not tool_name and not NOT_RUNNABLE.search(command):
                found.append((number, command))
    return found


def documented_commands() -> dict[str, list[str]]:
    """Every documented command -> where it is printed (``page:line``): the lines of fenced shell
    blocks and the complete commands printed inline."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for language, line, body in fenced_blocks(page):
            if language in SHELL_LANGUAGES:
                for offset, command in logical_lines(body, language):
                    found.setdefault(command, []).append(f"{page.relative_to(ROOT)}:{line + offset}")
        for number, command in inline_commands(page):
            found.setdefault(command, []).append(f"{page.relative_to(ROOT)}:{number}")
    return found


# ------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Run:
    """Run the command through bash with ``replace`` applied (``(documented text, text run)``;
    ``{ckpt}`` is the checkpoint written by ``after``, the documented command whose scratch
    directory this one shares; ``{ws}`` is the scratch directory) and ``extra`` appended at the
    end. ``writes``: globs (in the scratch directory) that must match afterwards. ``fixture``:
    data generated first (``ptb``: a Penn-Treebank-layout corpus in ``ptb/``; ``karpathy``: a
    Karpathy split with images in ``coco/``; ``images``: two PNGs in ``my_images/``;
    ``sentences``: German lines in ``my_sentences.de``). ``shared_data``: reads ../shared/data
    (skipped where it is absent). ``xfail``: a known defect, with its issue."""

    extra: tuple[str, ...] = ()
    replace: tuple[tuple[str, str], ...] = ()
    after: str | None = None
    writes: tuple[str, ...] = ()
    fixture: str | None = None
    shared_data: bool = False
    xfail: str | None = None


@dataclass(frozen=True)
class Collect:
    """A ``pytest`` command: collected with ``--collect-only`` from the repository root (its
    tests run in the suite); it must select at least one test; the files and tests it names must
    exist (``test_pytest_commands_name_existing_tests``)."""


@dataclass(frozen=True)
class AsInCI:
    """An install-and-run line: the part up to ``run_from`` must be a line of ``.ci/run`` (the
    part from it is run as ``Run(extra)`` when ``run_from`` is given; else the whole line must be
    in ``.ci/run``, which runs it)."""

    run_from: str | None = None
    extra: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Skip:
    reason: str


QUIET = ("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false")
LIMITS = ("--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
          "--trainer.limit_test_batches", "1", "--trainer.limit_predict_batches", "1", *QUIET)
TINY_LM_NETWORK = (
    "--model.init_args.encoder.init_args.embedding_dim", "16", "--model.init_args.encoder.init_args.hidden_size", "24",
    "--model.init_args.encoder.init_args.last_hidden_size", "16", "--data.init_args.batch_size", "4",
    "--data.init_args.eval_batch_size", "3", "--data.init_args.bptt", "8",
)
TINY_SYNTHETIC = (*TINY_LM_NETWORK, "--data.init_args.vocab_size", "60", "--data.init_args.train_tokens", "3000",
                  "--data.init_args.valid_tokens", "600", "--data.init_args.test_tokens", "600", *LIMITS)
TINY_PTB = (*TINY_LM_NETWORK, "--data.init_args.data_dir", "ptb", *LIMITS)
TINY_M30K_LM = (*TINY_LM_NETWORK, "--data.init_args.max_vocab", "2000", *LIMITS)
TINY_HIERARCHY = ("--data.init_args.train_per_class", "4", "--data.init_args.val_per_class", "1",
                  "--data.init_args.test_per_class", "2", *LIMITS)
TINY_SYNTHETIC_TRANSLATION = (
    "--model.init_args.network.init_args.embed_dim", "16", "--model.init_args.network.init_args.hidden_size", "16",
    "--model.init_args.val_bleu_sentences", "4", "--model.init_args.num_sample_translations", "1",
    "--data.init_args.max_tokens", "200", "--data.init_args.eval_max_tokens", "200", *LIMITS,
)
TINY_TRANSLATION = (*TINY_SYNTHETIC_TRANSLATION, "--data.init_args.vocab_size", "1000", "--trainer.max_time", "null")
TINY_CAPTIONING = (
    "--data.init_args.num_train", "8", "--data.init_args.num_val", "4", "--data.init_args.num_test", "4",
    "--data.init_args.image_size", "32", "--data.init_args.batch_size", "4",
    "--model.init_args.decoder.init_args.embed_dim", "16", "--model.init_args.decoder.init_args.hidden_size", "16",
    "--model.init_args.meteor", "false", "--model.init_args.metric_tokenizer", "simple", *LIMITS,
)
TINY_KARPATHY = (
    "--data.init_args.annotations", "coco/dataset_coco.json", "--data.init_args.image_root", "coco",
    "--data.init_args.image_size", "32", "--data.init_args.batch_size", "2",
    "--model.init_args.encoder.init_args.arch", "resnet18", "--model.init_args.encoder.init_args.weights", "null",
    "--model.init_args.decoder.init_args.embed_dim", "16", "--model.init_args.decoder.init_args.hidden_size", "16",
    "--model.init_args.meteor", "false", "--model.init_args.metric_tokenizer", "simple", *LIMITS,
)
TINY_HANZI = (
    "--data.init_args.image_size", "24", "--data.init_args.num_classes_limit", "8", "--data.init_args.train_writers", "2",
    "--data.init_args.batch_size", "16", "--model.init_args.encoder.init_args.channels", "[16, 32, 64]",
    "--model.init_args.encoder.init_args.out_features", "64", *LIMITS,
)
TINY_BENCH_TRANSLATION = ("--vocab", "200", "--hidden", "16", "--layers", "1", "--sentences", "2",
                          "--source-length", "4", "--length", "4", "--repeats", "1")
TINY_DEMO = ("--heads", "softmax", "mos", "--max-epochs", "1", "--no-floor", "--extra", *TINY_SYNTHETIC)

RELIABILITY_FIT = "python -m app fit --config configs/lm/synthetic.yaml --checkpoint.every_n_train_steps 500"
LIBRARY_FIT = "python -m app fit --config configs/lm/synthetic.yaml --config configs/heads/mos.yaml"
HIERARCHY_DS = "python -m app fit --config configs/hierarchy/ds10x10.yaml"
HIERARCHY_SOFTMAX = "python -m app fit --config configs/hierarchy/softmax10x10.yaml"
CAPTIONS_FIT = "python -m app fit --config configs/captioning/synthetic.yaml"
HANZI_FIT = "python -m app fit --config configs/hanzi/font_rendered.yaml [--config configs/hanzi/ds32.yaml]"
M30K_FIT = "python -m app fit --config configs/translation/multi30k_de_en_lstm.yaml"
RESULTS_CAPTIONS_FIT = ("OMP_NUM_THREADS=1 python -m app fit --config configs/captioning/synthetic.yaml "
                        "--trainer.default_root_dir /tmp/capt_full --trainer.logger.init_args.save_dir /tmp/capt_full")
RESULTS_HANZI_DS = ("OMP_NUM_THREADS=2 python -m app fit --config configs/hanzi/font_rendered.yaml "
                    "--config configs/hanzi/ds32.yaml --seed_everything 0")
RESULTS_HANZI_STAGED = RESULTS_HANZI_DS.replace("OMP_NUM_THREADS=2", "OMP_NUM_THREADS=1")


def routing_loss(from_epoch: int) -> str:
    """The CLI options that switch the DS head's routing loss on (weight 1) from ``from_epoch``."""
    return (" --model.init_args.head.init_args.routing_loss_weight 1.0 --trainer.callbacks+=tasks.callbacks.RoutingLoss"
            f" --trainer.callbacks.from_epoch={from_epoch}")


def routing_at_once(from_epoch: int) -> tuple[tuple[str, str], ...]:
    """The replacement that makes a tiny run start :func:`routing_loss` at once, so that it acts
    within the run's one epoch."""
    return ((f"from_epoch={from_epoch}", "from_epoch=0"),)


RESULTS_HANZI_ROUTED = RESULTS_HANZI_STAGED.replace(" --seed_everything 0", routing_loss(3) + " --seed_everything 0")
RESULTS_M30K_LM = "OMP_NUM_THREADS=1 python -m app fit --config configs/lm/multi30k_captions.yaml --trainer.max_epochs 2"
SYNTHETIC_TRANSLATION_FIT = "OMP_NUM_THREADS=1 python -m app fit --config configs/translation/synthetic_lstm.yaml"
DEMO_RANKS = "OMP_NUM_THREADS=1 python -m app demo --save-dir runs/demo_ranks"
SCREEN_DS16 = ("python -m app convert ds --ckpt_path runs/Multi30kCaptions-softmax/version_5/checkpoints/last.ckpt "
               "--num_experts 16 --flops_reduction 10 --output ds16_s0.ckpt")
CAPTIONS_LM = "OMP_NUM_THREADS=1 python -m app fit --config configs/lm/multi30k_captions.yaml"
CAPTIONS_BUDGET = " --trainer.max_epochs 1 --trainer.limit_train_batches 600 --seed_everything 0"
CAPTIONS_MIXTAPE = CAPTIONS_LM + " --config configs/heads/mixtape.yaml" + CAPTIONS_BUDGET
CAPTIONS_HYBRID_2 = (CAPTIONS_LM + " --config configs/heads/hybrid_lightrnn_mos.yaml --model.init_args.tie_weights false "
                     "--trainer.max_epochs 2 --trainer.limit_train_batches 400 --seed_everything 0")
MIXTAPE_ALL_GATED = ("OMP_NUM_THREADS=1 python -m app demo --heads mixtape --no-floor --save-dir runs/mix_r1 --extra "
                     "--model.init_args.head.init_args.frequent_fraction 1.0")
TINY_BENCH = ("--tiny", "--repeats", "1")
TINY_BENCH_HEADS = ("--tiny", "--repeats", "1", "--heads", "softmax,mos", "--no-memory")


HIERARCHY_DS100 = "OMP_NUM_THREADS=1 python -m app fit --config configs/hierarchy/ds100x100.yaml --seed_everything 0"


def quote(word: str) -> str:
    """``word`` as one shell word."""
    return word if re.fullmatch(r"[\w./:=,@+-]+", word) else "'" + word.replace("'", "'\\''") + "'"


def inserted(after: str, extra: tuple[str, ...]) -> tuple[str, str]:
    """A replacement that puts tiny overrides right after ``after`` (for lines where appending at
    the end would not reach the ``python -m app`` call: loops, ``&``)."""
    return after, " ".join([after, *(quote(word) for word in extra)])


def m30k(*, after: str | None = None, replace: tuple[tuple[str, str], ...] = (), writes: tuple[str, ...] = ()) -> Run:
    """A Multi30k translation command on the real files in ../shared/data, at tiny size."""
    return Run(extra=TINY_TRANSLATION, after=after, replace=replace, writes=writes, shared_data=True)


COMMANDS: dict[str, Run | Collect | AsInCI | Skip] = {
    # ----------------------------------------------------------------------------- README.md
    "test -d .venv || python3 -m venv .venv; .venv/bin/pip install -q -e '.[dev]' && .venv/bin/python -m app demo":
        AsInCI(run_from=".venv/bin/python -m app demo", extra=TINY_DEMO,
               writes=("runs/demo/SyntheticLM-softmax/version_0", "runs/demo/SyntheticLM-mos/version_0")),
    "test -d .venv || python3 -m venv .venv; .venv/bin/pip install -q -e '.[dev]' && .venv/bin/python -m pytest":
        AsInCI(),
    ".venv/bin/python -m app fit --config configs/lm/synthetic.yaml --config configs/heads/mos.yaml "
    "--trainer.max_epochs 5 --model.init_args.head.init_args.num_components 5":
        Run(TINY_SYNTHETIC, writes=("runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt",)),
    ".venv/bin/python -m app test --config configs/lm/synthetic.yaml --ckpt_path "
    "runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt":
        Run(TINY_SYNTHETIC, after=".venv/bin/python -m app fit --config configs/lm/synthetic.yaml --config "
            "configs/heads/mos.yaml --trainer.max_epochs 5 --model.init_args.head.init_args.num_components 5"),
    ".venv/bin/python -m app predict --config configs/lm/synthetic.yaml --ckpt_path PATH "
    "--model.init_args.predict_mode sample --model.init_args.predict_output samples.txt":
        Run(TINY_SYNTHETIC, replace=(("PATH", "{ckpt}"),), after=RELIABILITY_FIT, writes=("samples.txt",)),
    ".venv/bin/python -m app fit --config configs/lm/ptb.yaml --config configs/heads/mixtape.yaml --print_config":
        Run(),
    "python -m app demo --heads softmax mos": Run(TINY_DEMO[3:], writes=("runs/demo/SyntheticLM-mos/version_0",)),
    "python -m app demo --help": Run(),
    "python -m app --help": Run(),
    "python -m app fit --help": Run(),
    'python -c "import torch"': Run(),
    'python -c "import lightning"': Run(),
    "python3 -m venv .venv && .venv/bin/pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu":
        Skip("needs download.pytorch.org, which this machine cannot reach"),
    ".venv/bin/pip install -e '.[dev]'": Skip("installs into the venv the tests run in (the README's test command does the same)"),
    # ----------------------------------------------------------------------------- docs/reliability.md
    RELIABILITY_FIT: Run(TINY_SYNTHETIC, writes=("runs/SyntheticLM-softmax/version_0/checkpoints/last.ckpt",)),
    RELIABILITY_FIT + " --ckpt_path last":
        Run((*TINY_SYNTHETIC, "--trainer.max_epochs", "2"), after=RELIABILITY_FIT,
            writes=("runs/SyntheticLM-softmax/version_0/checkpoints/last.ckpt",)),
    # ----------------------------------------------------------------------------- docs/ddp.md
    "python -m app fit --config configs/lm/ptb.yaml --config configs/heads/mos.yaml --trainer.accelerator gpu "
    "--trainer.devices 4 --trainer.strategy ddp":
        # No GPU here: the same command on two CPU (gloo) processes.
        Run(TINY_PTB, replace=(("--trainer.accelerator gpu --trainer.devices 4", "--trainer.accelerator cpu --trainer.devices 2"),),
            fixture="ptb", writes=("runs/TextCorpus-mos/version_0/checkpoints/last.ckpt",)),
    "python -m app fit --config configs/lm/ptb.yaml --trainer.accelerator gpu --trainer.devices 4 "
    "--trainer.strategy DDPStrategy --trainer.strategy.init_args.timeout 0:15:00":
        # No GPU here: two CPU (gloo) processes with the documented strategy class and timeout.
        Run(TINY_PTB, replace=(("--trainer.accelerator gpu --trainer.devices 4", "--trainer.accelerator cpu --trainer.devices 2"),),
            fixture="ptb", writes=("runs/TextCorpus-softmax/version_0/checkpoints/last.ckpt",)),
    "python -m app fit --config ... --trainer.accelerator gpu --trainer.devices N --trainer.num_nodes M "
    "--trainer.strategy ddp --trainer.default_root_dir /shared/runs --trainer.logger.init_args.save_dir /shared/runs":
        # One node, two CPU processes; "..." is a task config, /shared a scratch directory.
        Run(TINY_SYNTHETIC, replace=(("--config ...", "--config configs/lm/synthetic.yaml"),
                                     ("--trainer.accelerator gpu", "--trainer.accelerator cpu"), ("devices N", "devices 2"),
                                     ("num_nodes M", "num_nodes 1"), ("/shared/runs", "{ws}/shared/runs")),
            writes=("shared/runs/SyntheticLM-softmax/version_0/checkpoints/last.ckpt",)),
    # ----------------------------------------------------------------------------- docs/hierarchy.md
    HIERARCHY_DS: Run(TINY_HIERARCHY, writes=("runs/HierarchyDataModule-ds_softmax/version_0/checkpoints/last.ckpt",)),
    HIERARCHY_SOFTMAX: Run(TINY_HIERARCHY, writes=("runs/HierarchyDataModule-softmax/version_0/checkpoints/last.ckpt",)),
    "python -m app test --config configs/hierarchy/<same>.yaml --ckpt_path "
    "runs/HierarchyDataModule-<head>/version_0/checkpoints/last.ckpt":
        Run(TINY_HIERARCHY, replace=(("<same>", "ds10x10"), ("<head>", "ds_softmax")), after=HIERARCHY_DS),
    "python -m app analyze experts --ckpt_path runs/HierarchyDataModule-ds_softmax/version_0/checkpoints/last.ckpt --split test":
        Run(("--threads", "1", "--latency_repeats", "1"), after=HIERARCHY_DS),
    # ----------------------------------------------------------------------------- docs/captioning.md
    "python -m app fit --config configs/captioning/synthetic.yaml":
        Run(TINY_CAPTIONING, writes=("runs/SyntheticScenes-softmax/version_0/checkpoints/last.ckpt",)),
    "python -m app test --config configs/captioning/synthetic.yaml --ckpt_path "
    "runs/SyntheticScenes-softmax/version_0/checkpoints/last.ckpt":
        Run(TINY_CAPTIONING, after=CAPTIONS_FIT),
    "python -m app predict --config configs/captioning/synthetic.yaml --ckpt_path ... "
    "--model.init_args.predict_output captions.json":
        Run(TINY_CAPTIONING, replace=(("--ckpt_path ...", "--ckpt_path {ckpt}"),), after=CAPTIONS_FIT,
            writes=("captions.json",)),
    "python -m app fit --config configs/captioning/coco_karpathy.yaml":
        # COCO is not on this machine: a generated Karpathy split with six images.
        Run(TINY_KARPATHY, fixture="karpathy", writes=("runs/KarpathyCaptions-softmax/version_0/checkpoints/last.ckpt",)),
    # ----------------------------------------------------------------------------- docs/hanzi.md
    HANZI_FIT: Run(TINY_HANZI, replace=(("[--config configs/hanzi/ds32.yaml]", ""),)),
    "python -m app test --config configs/hanzi/font_rendered.yaml --ckpt_path runs/.../last.ckpt":
        Run(TINY_HANZI, replace=(("runs/.../last.ckpt", "{ckpt}"),), after=HANZI_FIT),
    "python -m app predict --config configs/hanzi/font_rendered.yaml --ckpt_path ... "
    "--data.init_args.predict_dir my_images/ --trainer.callbacks.output_path predictions.csv":
        Run(TINY_HANZI, replace=(("--ckpt_path ...", "--ckpt_path {ckpt}"),), after=HANZI_FIT, fixture="images",
            writes=("predictions.csv",)),
    # ----------------------------------------------------------------------------- docs/translation.md
    "python -m app fit --config configs/translation/multi30k_de_en_lstm.yaml": m30k(),
    "python -m app test --config configs/translation/multi30k_de_en_lstm.yaml --ckpt_path runs/.../best-*.ckpt "
    "--model.init_args.test_output test.hyp":
        m30k(after=M30K_FIT, replace=(("runs/.../best-*.ckpt", "{ckpt}"),), writes=("test.hyp",)),
    "python -m app predict --config configs/translation/multi30k_de_en_lstm.yaml --ckpt_path runs/.../best-*.ckpt "
    "--data.init_args.predict_file my_sentences.de --model.init_args.predict_output my_sentences.en":
        Run((*TINY_TRANSLATION, ), after=M30K_FIT, fixture="sentences", shared_data=True,
            replace=(("runs/.../best-*.ckpt", "{ckpt}"),), writes=("my_sentences.en",)),
    "OMP_NUM_THREADS=1 python -m app bench translation --heads softmax,mos3,hybrid-mos3 --scoring both --vocab 7960 --repeats 7":
        Run(TINY_BENCH_TRANSLATION),
    # ----------------------------------------------------------------------------- docs/library.md
    "python examples/plain_pytorch.py --steps 120": Run(("--steps", "20")),
    LIBRARY_FIT: Run(TINY_SYNTHETIC, writes=("runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt",)),
    "python -m app convert export --ckpt_path runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt --output mos.pt2 "
    "--method topk --k 10": Run(after=LIBRARY_FIT, writes=("mos.pt2",)),
    "python -m app convert export --ckpt_path runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt --output mos.onnx "
    "--method topk --k 10": Run(after=LIBRARY_FIT, writes=("mos.onnx",)),
    "python -m app convert export --ckpt_path runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt --output lm.onnx "
    "--part network --method log_prob": Run(after=LIBRARY_FIT, writes=("lm.onnx",)),
    # ----------------------------------------------------------------------------- docs/heads.md
    "python -m app fit --config configs/lm/multi30k_captions.yaml --config configs/heads/mixtape.yaml":
        Run(TINY_M30K_LM, shared_data=True, writes=("runs/Multi30kCaptions-mixtape/version_0/checkpoints/last.ckpt",)),
    "python -m app analyze rank --ckpt_path runs/.../softmax.ckpt runs/.../mos.ckpt --split test --max_contexts 2000":
        Run(("--max_contexts", "50"), after=RELIABILITY_FIT,
            replace=(("runs/.../softmax.ckpt", "{ckpt}"), ("runs/.../mos.ckpt", "{ckpt}"))),
    "python -m app analyze rank --log_probs matrix.pt": Run(fixture="log_probs", writes=("runs/rank/singular_value_cdf.png",)),
    DEMO_RANKS: Run(("--heads", "softmax", "moc", "sigsoftmax", "mos", "mixtape", "--max-epochs", "1", "--no-floor",
                     "--extra", *TINY_SYNTHETIC)),
    "python -m app analyze rank --ckpt_path runs/demo_ranks/SyntheticLM-{softmax,moc,sigsoftmax,mos,mixtape}/version_0/"
    "checkpoints/best-*.ckpt --max_contexts 2000": Run(("--max_contexts", "50"), after=DEMO_RANKS),
    # ----------------------------------------------------------------------------- docs/hybrid_lightrnn.md
    "OMP_NUM_THREADS=1 python -m app bench lightrnn --threads 1 --repeats 3 --budget 3,5,9,15":
        Run(("--tiny", "--repeats", "1", "--no-memory")),
    # ----------------------------------------------------------------------------- docs/benchmarks.md
    "python -m app bench train --preset wikitext2 --threads 1 --repeats 5 --no-budget": Run(("--tiny", "--repeats", "1")),
    "python -m app bench train --preset 1b --heads softmax,mixtape,mos:7,ds_softmax:64 --threads 1 --repeats 3 --no-budget":
        Run(("--tiny", "--repeats", "1")),
    "python -m app bench train --preset wmt --heads softmax,mixtape,mos:15 --threads 1 --repeats 3 --no-budget":
        Run(("--tiny", "--repeats", "1")),
    "python -m app bench infer --preset 1b": Run(("--tiny", "--repeats", "1")),
    # ----------------------------------------------------------------------------- docs/ds_softmax.md
    "python -m app fit --config configs/lm/multi30k_captions.yaml --config configs/heads/ds16.yaml --pretrained.checkpoint "
    "runs/Multi30kCaptions-softmax/version_0/checkpoints/last.ckpt":
        Run(TINY_M30K_LM, after="python -m app fit --config configs/lm/multi30k_captions.yaml", shared_data=True,
            writes=("runs/Multi30kCaptions-ds_softmax/version_0/checkpoints/last.ckpt",)),
    SCREEN_DS16: Run(("--max_tokens", "2000"), after=RESULTS_M30K_LM, shared_data=True,
                     replace=(("runs/Multi30kCaptions-softmax/version_5/checkpoints/last.ckpt", "{ckpt}"),),
                     writes=("ds16_s0.ckpt",)),
    "python -m app test --config configs/lm/multi30k_captions.yaml --config configs/heads/ds_screened.yaml "
    "--ckpt_path ds16_s0.ckpt": Run(TINY_M30K_LM, after=SCREEN_DS16, shared_data=True),
    "python -m app analyze experts --ckpt_path ds16_s0.ckpt --split test":
        Run(("--latency_repeats", "1"), after=SCREEN_DS16, shared_data=True),
    "python -m app bench ds --softmax_ckpt runs/Multi30kCaptions-softmax/version_5/checkpoints/last.ckpt --repeats 5 --flat_ip":
        Run(("--samples", "4", "--batches", "1", "--batch_size", "8", "--repeats", "1", "--warmup", "0", "--contexts", "200",
             "--screen_experts", "2", "--screen_flops_reduction", "1.2", "--screen_tokens", "2000"),
            after=RESULTS_M30K_LM, shared_data=True,
            replace=(("runs/Multi30kCaptions-softmax/version_5/checkpoints/last.ckpt", "{ckpt}"),)),
    # ----------------------------------------------------------------------------- docs/lm.md
    "python -m app analyze floor --widths 8 16 32": Run(("--contexts", "200", "--iterations", "20", "--restarts", "1")),
    # ----------------------------------------------------------------------------- docs/results/*.md
    CAPTIONS_MIXTAPE: Run(TINY_M30K_LM, shared_data=True,
                          writes=("runs/Multi30kCaptions-mixtape/version_0/checkpoints/last.ckpt",)),
    # docs/results/benchmarks.md and heads.md: benchmark records (tiny sizes; two heads where a record times all)
    "python -m app bench train --preset ptb --heads softmax,moc,mixtape,sigsoftmax,mos:15 --batch 12 --no-budget --repeats 5 "
    "--threads 1": Run(TINY_BENCH),
    "python -m app bench train --preset ptb --heads softmax,mixtape,mos:15,sigsoftmax --no-budget --repeats 5 --threads 1":
        Run(TINY_BENCH),
    "python -m app bench train --preset ptb --heads softmax,mixtape,mos:15 --budget 1.0 --no-same-batch --budget-repeats 2 "
    "--threads 1": Run((*TINY_BENCH, "--budget-repeats", "1", "--budget", "0.25")),  # options given win over --tiny
    "python -m app bench infer --preset ptb --csv infer_ptb.csv": Run(TINY_BENCH, writes=("infer_ptb.csv",)),
    "python -m app bench heads --threads 1 --repeats 5": Run(TINY_BENCH_HEADS),
    "python -m app bench heads --threads 1 --no-memory --heads softmax,moc,mos,mixtape,sigsoftmax --repeats 3":
        Run(TINY_BENCH_HEADS),
    "python -m app bench heads --threads 1 --no-memory --heads softmax,mos --repeats 7": Run(TINY_BENCH_HEADS),
    "python -m app bench heads --threads 1 --heads softmax,adaptive_softmax --repeats 7":
        Run(("--tiny", "--repeats", "1", "--heads", "softmax,adaptive_softmax", "--no-memory")),
    "python -m app bench heads --threads 1 --repeats 3 --tokens 256 --vocab 100000 --components 7 --heads softmax,mos,mixtape":
        Run((*TINY_BENCH_HEADS, "--tokens", "24", "--vocab", "60", "--components", "3")),  # sizes given win over --tiny
    MIXTAPE_ALL_GATED: Run(TINY_SYNTHETIC, replace=(inserted("--no-floor", ("--max-epochs", "1")),),
                           writes=("runs/mix_r1/SyntheticLM-mixtape/version_0/checkpoints/last.ckpt",)),
    # docs/results/hybrid_lightrnn.md
    "python -c 'from app.checkpoint_io import read_checkpoint; from heads.lightrnn import HybridLightRNNCodebook as Book; "
    'ck = read_checkpoint("last.ckpt"); [print(row, *words) for row, words in '
    'Book.from_structure(ck["head_structure"]).table_rows(ck["datamodule_state"]["class_names"], 10, 12)]\'':
        Run(shared_data=True, after=CAPTIONS_HYBRID_2, replace=(("last.ckpt", "{ckpt}"),)),
    RESULTS_CAPTIONS_FIT:
        Run(TINY_CAPTIONING, replace=(("/tmp/capt_full", "{ws}/capt_full"),),
            writes=("capt_full/SyntheticScenes-softmax/version_0/checkpoints/last.ckpt",)),
    "OMP_NUM_THREADS=1 python -m app test --config configs/captioning/synthetic.yaml --ckpt_path "
    "/tmp/capt_full/SyntheticScenes-softmax/version_0/checkpoints/best-epoch=5-step=698.ckpt "
    "--model.init_args.test_output /tmp/capt_full/test_captions.json":
        Run(TINY_CAPTIONING, after=RESULTS_CAPTIONS_FIT, writes=("capt_full/test_captions.json",),
            replace=(("/tmp/capt_full/SyntheticScenes-softmax/version_0/checkpoints/best-epoch=5-step=698.ckpt", "{ckpt}"),
                     ("/tmp/capt_full", "{ws}/capt_full"))),
    'for h in softmax mos mixtape; do extra=; [ $h != softmax ] && extra="--config configs/captioning/synthetic_$h.yaml"; '
    "OMP_NUM_THREADS=1 python -m app fit --config configs/captioning/synthetic.yaml $extra --trainer.max_epochs 1 "
    "--trainer.default_root_dir /tmp/capt_cmp_$h --trainer.logger.init_args.save_dir /tmp/capt_cmp_$h & done; wait":
        Run(replace=(inserted("--trainer.max_epochs 1", TINY_CAPTIONING), ("/tmp/capt_cmp_", "{ws}/capt_cmp_")),
            writes=tuple(f"capt_cmp_{h}/SyntheticScenes-{h}/version_0/checkpoints/last.ckpt" for h in ("softmax", "mos", "mixtape"))),
    HIERARCHY_DS100:
        Run(TINY_HIERARCHY, writes=("runs/HierarchyDataModule-ds_softmax/version_0/checkpoints/last.ckpt",)),
    "python -m app bench ds --repeats 5": Run(("--tiny", "--repeats", "1", "--threads", "1")),
    # ----------------------------------------------------------------------------- printed inline (tables, prose)
    "python -m app bench heads --heads softmax --repeats 7 --threads 1":
        Run(("--tiny", "--repeats", "1", "--no-memory")),
    'python -c "import time; from datamodules import SyntheticLM; t=time.time(); dm=SyntheticLM(); dm.setup(); '
    'dm.true_entropy; print(time.time()-t)"': Run(),
    "python -m app bench mitosis --json mitosis.json": Run(("--tiny",), writes=("mitosis.json",)),
    "OMP_NUM_THREADS=2 python -m app bench hanzi --threads 2":
        Run(("--num_classes", "20", "--batch_size", "4", "--features", "16", "--threads", "1", "--warmup", "0",
             "--repeats", "1", "--variants", "8-16:1:1:32")),
    "OMP_NUM_THREADS=1 python -m app bench lightrnn --threads 1 --repeats 3 --heads softmax,mos,hybrid-mos,codes-mos":
        Run(("--tiny", "--repeats", "1", "--no-memory")),
    "python -m app bench heads --threads 1 --no-memory": Run(("--tiny", "--repeats", "1", "--heads", "softmax,mos")),
    "OMP_NUM_THREADS=1 python -m app bench heads --heads mos --repeats 3 --warmup 1 --threads 1 --no-memory":
        Run(("--tiny", "--repeats", "1", "--warmup", "0")),
    "python -m app fit --config configs/lm/synthetic.yaml --config configs/heads/mos.yaml --model.init_args.compile true":
        Run(TINY_SYNTHETIC, writes=("runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt",)),
    RESULTS_HANZI_ROUTED: Run(TINY_HANZI, replace=routing_at_once(3)),
    RESULTS_M30K_LM: Run(TINY_M30K_LM, shared_data=True,
                         writes=("runs/Multi30kCaptions-softmax/version_0/checkpoints/last.ckpt",)),
    SYNTHETIC_TRANSLATION_FIT:
        Run(TINY_SYNTHETIC_TRANSLATION, writes=("runs/TranslationDataModule-softmax/version_0/checkpoints/last.ckpt",)),
    "OMP_NUM_THREADS=1 python -m app bench translation --heads softmax,mos,mixtape --vocab 8000 --train-tokens 3000":
        Run((*TINY_BENCH_TRANSLATION, "--train-tokens", "20")),
    "OMP_NUM_THREADS=1 python -m app bench translation --heads softmax,mos3,hybrid-mos3,codes-mos3 --vocab 7960 --repeats 3 "
    "--train-tokens 3000": Run((*TINY_BENCH_TRANSLATION, "--train-tokens", "20")),
}


#: The tiny sizes of a documented ``fit`` that has no COMMANDS entry, by the prefix of its first
#: ``--config``: a new documented run of a shipped config is run without an entry.
TINY_BY_CONFIG: dict[str, Run] = {
    "configs/lm/synthetic.yaml": Run(TINY_SYNTHETIC),
    "configs/lm/multi30k_captions.yaml": Run(TINY_M30K_LM, shared_data=True),
    "configs/hierarchy/": Run(TINY_HIERARCHY),
    "configs/hanzi/font_rendered.yaml": Run(TINY_HANZI),
    "configs/captioning/synthetic.yaml": Run(TINY_CAPTIONING),
    "configs/translation/multi30k_de_en_lstm.yaml": m30k(),
    "configs/translation/synthetic_": Run(TINY_SYNTHETIC_TRANSLATION),
}
PYTEST_COMMAND = re.compile(r"(\w+=\S+ )*(\.venv/bin/)?python3? -m pytest ")
FIT_COMMAND = re.compile(r"(\w+=\S+ )*(\.venv/bin/)?python3? -m app fit --config (\S+)")


def default_entry(command: str) -> Run | Collect | None:
    """How a documented command without a COMMANDS entry runs, or None if it needs an entry."""
    if PYTEST_COMMAND.match(command):
        return Collect()
    fit = FIT_COMMAND.match(command)
    if fit:
        for prefix, run in TINY_BY_CONFIG.items():
            if fit.group(3).startswith(prefix):
                # one thread per test process, whatever thread count the docs print
                threads = tuple((f"OMP_NUM_THREADS={n}", "OMP_NUM_THREADS=1") for n in (2, 4)
                                if command.startswith(f"OMP_NUM_THREADS={n} "))
                return Run(run.extra, replace=threads, shared_data=run.shared_data)
    return None


def entry_for(command: str) -> Run | Collect | AsInCI | Skip | None:
    return COMMANDS[command] if command in COMMANDS else default_entry(command)


# ------------------------------------------------------------------------------------ running
def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("HEADBENCH_DEBUG", None)
    return env


def make_workspace(base: Path, cache: Path) -> Path:
    """A scratch checkout: ``base/main`` with ``configs`` and ``.venv`` linked, ``base/shared``
    linking the shared data, so the docs' relative paths hold; ``.cache`` (BPE models, generated
    corpora) is one directory for the whole session."""
    workspace = base / "main"
    workspace.mkdir(parents=True)
    (workspace / "configs").symlink_to(ROOT / "configs")
    (workspace / ".venv").symlink_to(ROOT / ".venv")
    if (ROOT / "examples").is_dir():
        (workspace / "examples").symlink_to(ROOT / "examples")
    (workspace / ".cache").symlink_to(cache, target_is_directory=True)
    if (ROOT.parent / "shared").exists():
        (base / "shared").symlink_to(ROOT.parent / "shared")
    return workspace


def newest_checkpoint(workspace: Path) -> str:
    """The ``last.ckpt`` most recently written below ``workspace`` (else any checkpoint)."""
    found = glob.glob(str(workspace / "**" / "last.ckpt"), recursive=True) or glob.glob(
        str(workspace / "**" / "*.ckpt"), recursive=True)
    assert found, f"the prerequisite command wrote no checkpoint below {workspace}"
    return max(found, key=os.path.getmtime)


def command_to_run(command: str, run: Run, workspace: Path, checkpoint: str | None) -> str:
    text = command
    for documented, replacement in run.replace:
        assert documented in text, f"replacement {documented!r} is not in the command {command!r}"
        text = text.replace(documented, replacement)
    text = text.replace("{ws}", str(workspace)).replace("{ckpt}", checkpoint or "{ckpt}")
    assert "{ckpt}" not in text, f"{command!r} names a checkpoint but has no prerequisite command"
    return " ".join([text, *(quote(word) for word in run.extra)])


class Runner:
    """Runs documented commands once per test session; dependents share their prerequisite's
    scratch directory."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.cache = base / "cache"
        self.cache.mkdir(exist_ok=True)
        self.done: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}
        self.created = 0

    def run(self, command: str, run: Run) -> tuple[Path, subprocess.CompletedProcess]:
        if command in self.done:
            return self.done[command]
        if run.shared_data and not SHARED_DATA.is_dir():
            pytest.skip(f"needs the real data in {SHARED_DATA} (see its README)")
        checkpoint = None
        if run.after:
            prerequisite = entry_for(run.after)
            assert isinstance(prerequisite, Run), f"the prerequisite {run.after!r} is not a command that runs"
            workspace, first = self.run(run.after, prerequisite)
            assert first.returncode == 0, f"the prerequisite {run.after!r} failed:\n{first.stderr[-3000:]}"
            checkpoint = newest_checkpoint(workspace)
        else:
            self.created += 1
            workspace = make_workspace(self.base / f"c{self.created}", self.cache)
        make_fixture(workspace, run.fixture)
        text = command_to_run(command, run, workspace, checkpoint)
        done = subprocess.run(["bash", "-c", text], cwd=workspace, env=environment(), capture_output=True, text=True,
                              timeout=900)
        self.done[command] = (workspace, done)
        return workspace, done


def make_fixture(workspace: Path, fixture: str | None) -> None:
    if fixture is None:
        return
    marker = workspace / f".fixture-{fixture}"
    if marker.exists():
        return
    if fixture == "ptb":
        write_corpus(workspace / "ptb", PTB)
    elif fixture == "karpathy":
        (workspace / "coco").mkdir()
        write_karpathy_fixture(workspace / "coco")
    elif fixture == "images":
        from PIL import Image

        (workspace / "my_images").mkdir()
        for index in range(2):
            Image.new("L", (24, 24), 60 * index).save(workspace / "my_images" / f"char{index}.png")
    elif fixture == "log_probs":
        import torch

        torch.save(torch.log_softmax(torch.randn(40, 30, generator=torch.Generator().manual_seed(0)), -1),
                   workspace / "matrix.pt")
    elif fixture == "sentences":
        (workspace / "my_sentences.de").write_text("ein Mann fährt Fahrrad .\nzwei Hunde spielen im Schnee .\n",
                                                   encoding="utf-8")
    else:
        raise AssertionError(f"unknown fixture {fixture!r}")
    marker.touch()


@pytest.fixture(scope="session")
def runner(tmp_path_factory) -> Runner:
    return Runner(tmp_path_factory.mktemp("doc_commands"))


# ------------------------------------------------------------------------------------ tests
def test_every_fenced_block_names_its_language():
    untagged = [f"{page.relative_to(ROOT)}:{line}" for page in PAGES for language, line, _ in fenced_blocks(page)
                if not language]
    assert not untagged, f"fenced blocks without a language (bash for commands, text for output): {untagged}"


INDENTED_COMMAND = re.compile(r"^ {4,}(\w+=\S+ )*((\.venv/bin/)?(python3?|pip) |test -d |bash |sacrebleu |tensorboard )")


def test_the_docs_print_commands_in_fenced_blocks():
    """A command in an indented block is run by no test: README.md, the reference pages and the
    measurement records (docs/**/*.md) print every command in a fenced bash block."""
    found = []
    for page in PAGES:
        found += [f"{page.relative_to(ROOT)}:{number}" for number, line in enumerate(outside_fences(page), 1)
                  if INDENTED_COMMAND.match(line)]
    assert not found, f"commands in indented blocks (put them in a fenced bash block with a COMMANDS entry): {found}"


def test_every_documented_command_has_an_entry():
    documented = documented_commands()
    missing = {command: where for command, where in documented.items() if entry_for(command) is None}
    assert not missing, "documented commands with no entry in tests/test_doc_commands.py COMMANDS:\n" + "\n".join(
        f"  {where}: {command}" for command, where in missing.items())
    stale = sorted(set(COMMANDS) - set(documented))
    assert not stale, f"COMMANDS entries whose command is no longer documented: {stale}"


def test_pytest_commands_name_existing_tests():
    """Every file and ``file::test`` a documented pytest command names exists (the slow
    ``test_documented_command`` also collects them)."""
    for command in documented_commands():
        if not isinstance(entry_for(command), Collect):
            continue
        for word in command.split():
            if word.startswith("tests/"):
                path, _, name = word.partition("::")
                assert (ROOT / path).is_file(), f"{command}: no {path}"
                if name:
                    assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), \
                        f"{command}: no test {name} in {path}"


def params():
    for command in sorted(documented_commands()):
        entry, marks = entry_for(command), []
        if isinstance(entry, Run) and entry.xfail:
            marks.append(pytest.mark.xfail(reason=entry.xfail, strict=True))
        yield pytest.param(command, marks=marks, id=command)


@pytest.mark.parametrize("command", list(params()))
def test_documented_command(command, runner):
    entry = entry_for(command)
    assert entry is not None, f"{command!r} has no COMMANDS entry (test_every_documented_command_has_an_entry)"
    if isinstance(entry, Skip):
        pytest.skip(entry.reason)
    if isinstance(entry, Collect):
        words = command.replace(".venv/bin/python", sys.executable, 1)
        done = subprocess.run(["bash", "-c", f"{words} --collect-only -p no:cacheprovider"], cwd=ROOT, env=environment(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        assert re.search(r"\b[1-9]\d* tests? (collected|selected)|collected [1-9]", done.stdout), done.stdout[-2000:]
        return
    if isinstance(entry, AsInCI):
        ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        head = command.split(entry.run_from)[0] if entry.run_from else command
        assert any(line.startswith(head.rstrip()) for line in ci_lines), \
            f"{head!r} is not as in .ci/run (the README's install line must match what CI runs)"
        if entry.run_from is None:
            return
        command, entry = entry.run_from, Run(entry.extra, writes=entry.writes)
    workspace, done = runner.run(command, entry)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    for pattern in entry.writes:
        assert glob.glob(str(workspace / pattern)), f"{command} should have written {pattern}"


# ------------------------------------------------------------------------------------ names in the docs
#: Names the docs print on purpose although they do not exist: an example of a mistyped class
#: (docs/bad_inputs.md), the files a reader creates when adding a head (README.md) and the
#: DS-Softmax head configs by their expert count N (an error line in docs/bad_inputs.md).
NOT_IN_THE_TREE = {"tasks.LanguageModl", "heads/my_head.py", "configs/heads/my_head.yaml", "configs/heads/dsN.yaml"}
PROJECT_PATH = re.compile(r"(?<![\w/.-])(?:app|heads|tasks|datamodules|tests|configs|docs)/[\w/.*-]*[\w*]")
DOTTED_NAME = re.compile(r"(?<![\w/.-])(?:app|heads|tasks|datamodules)(?:\.\w+)+")


def resolves(dotted: str) -> bool:
    """``package.module[.attribute...]`` imports and its attributes exist."""
    import importlib

    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_paths_and_module_names_in_the_docs_exist():
    """Every project file path (``app/runtime/locks.py``, ``configs/heads/*.yaml``) and dotted
    name (``heads.ds.build.pruned_head``) printed in README.md and docs/**/*.md exists in the tree
    (a path may be relative to the page or to configs/, e.g. ``translation/heads/mos.yaml``)."""
    wrong = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for match in PROJECT_PATH.finditer(line):
                path = match.group(0)
                if line[match.end():match.end() + 1] in ("{", "$", "<"):  # configs/heads/lstm_{mos,mixtape}.yaml
                    path += "*"
                folders = [ROOT, page.parent, ROOT / "configs", *(ROOT / "configs").glob("*")]
                candidates = [folder / path for folder in folders]
                if path not in NOT_IN_THE_TREE and not any(glob.glob(str(c)) for c in candidates):
                    wrong.append(f"{page.relative_to(ROOT)}:{number}: {path}")
            for match in DOTTED_NAME.finditer(line):
                name = match.group(0)
                if not name.endswith((".py", ".md", ".yaml")) and name not in NOT_IN_THE_TREE and not resolves(name):
                    wrong.append(f"{page.relative_to(ROOT)}:{number}: {name}")
    assert not wrong, "names in the docs that are not in the tree:\n" + "\n".join(wrong)


def test_the_docs_index_lists_every_page():
    """docs/README.md links every page of docs/ and docs/results/."""
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w/]+\.md)\)", index))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md") if p.name != "README.md"
             or p.parent != ROOT / "docs"}
    assert not pages - linked, f"pages missing from docs/README.md: {sorted(pages - linked)}"


PROJECT_PACKAGES = ("app", "datamodules", "heads", "tasks")


def test_python_blocks_parse_and_import_what_exists():
    """Every fenced ``python`` block of README.md and docs/**/*.md is valid Python, and every
    project name it imports (``from tasks.decoding import beam_search``) exists, so a renamed
    module or function cannot leave a snippet behind. (The blocks are fragments: they use names
    such as ``hidden`` that the page describes, so they are parsed, not run.)"""
    import ast

    wrong = []
    for page in PAGES:
        for language, line, body in fenced_blocks(page):
            if language != "python":
                continue
            where = f"{page.relative_to(ROOT)}:{line}"
            try:
                tree = ast.parse(body)
            except SyntaxError as error:
                wrong.append(f"{where}: {error}")
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
                    wrong += [f"{where}: {node.module}.{alias.name}" for alias in node.names
                              if not resolves(f"{node.module}.{alias.name}")]
                elif isinstance(node, ast.Import):
                    wrong += [f"{where}: {alias.name}" for alias in node.names
                              if alias.name.split(".")[0] in PROJECT_PACKAGES and not resolves(alias.name)]
    assert not wrong, "python blocks in the docs that do not parse or import names that do not exist:\n" + "\n".join(wrong)


#: Fenced python blocks that are whole programs, keyed by page and first line: ``test_python_block_runs``
#: runs each. Every other python block is a fragment that uses names
#: its page describes (a head, an optimizer, a model) and is listed in PYTHON_FRAGMENTS.
RUNNABLE_PYTHON = {
    ("README.md", "import torch, heads"),
    ("docs/library.md", "import torch, heads"),
    ("docs/results/data.md", "# OMP_NUM_THREADS=1 python this.py"),
    ("docs/results/translation.md", "import time, torch"),
}
PYTHON_FRAGMENTS = {
    ("docs/library.md", "head.clone_experts(optimizers=[optimizer])          # mitosis: K -> 2K experts (§2, Fig. 2)"),
    ("docs/library.md", "for tokens, targets in batches:"),
    ("docs/library.md", 'program = torch.export.load("mos.pt2").module()'),
    ("docs/library.md", "import numpy as np, onnxruntime"),
}


def python_blocks() -> dict[tuple[str, str], str]:
    blocks = {}
    for page in PAGES:
        for language, _, body in fenced_blocks(page):
            if language == "python":
                first = next(line for line in body.splitlines() if line.strip())
                blocks[(page.relative_to(ROOT).as_posix(), first)] = body
    return blocks


def test_every_python_block_is_a_program_or_a_listed_fragment():
    found = set(python_blocks())
    unlisted = found - set(RUNNABLE_PYTHON) - PYTHON_FRAGMENTS
    stale = (set(RUNNABLE_PYTHON) | PYTHON_FRAGMENTS) - found
    assert not unlisted, f"python blocks in the docs neither run nor listed as fragments: {sorted(unlisted)}"
    assert not stale, f"RUNNABLE_PYTHON / PYTHON_FRAGMENTS entries with no such block: {sorted(stale)}"


@pytest.mark.parametrize("key", sorted(RUNNABLE_PYTHON), ids=lambda key: f"{key[0]}: {key[1]}")
def test_python_block_runs(key, tmp_path):
    """A documented program runs as printed, from a scratch directory, in a fresh interpreter."""
    body = python_blocks()[key]
    done = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=environment(), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"{key}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
