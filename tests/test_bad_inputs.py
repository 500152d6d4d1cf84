"""The bad-input catalogue (docs/bad_inputs.md): the entries not already tested beside their
component. Each bad input gives one line that names the value, the rule and the fix; from
the shell (`python -m app ...`) that line is all the user sees, with exit code 2, and nothing
is written."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from app.main import main
from datamodules.captioning import KarpathyCaptions
from datamodules.hanzi import gnt_files
from datamodules.text import read_corpus
from datamodules.text_corpus import TextCorpus
from datamodules.translation import TranslationDataModule
from heads.ds import DSSoftmax
from tasks.callbacks import Mitosis
from tasks.classification import ClassificationTask
from tasks.encoders import MLPEncoder
from tests.conftest import TinyConfig
from tests.shell import one_error_line, run_cli, time_limit

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = str(ROOT / "configs/lm/synthetic.yaml")


def one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


# ---------------------------------------------------------------------------------- CLI names
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model", "tasks.LanguageModl"], "unknown model class_path 'tasks.LanguageModl'"),
        (["--model.class_path", "nowhere.Task"], "unknown model class_path 'nowhere.Task' (No module named 'nowhere')"),
        (["--data", "datamodules.SyntheticLN"], "unknown data class_path 'datamodules.SyntheticLN'"),
        (["--model", "datamodules.SyntheticLM"], "model class_path 'datamodules.SyntheticLM' is not a LightningModule"),
        (["--data", "tasks.LanguageModel"], "data class_path 'tasks.LanguageModel' is not a LightningDataModule"),
    ],
)
def test_unknown_or_wrong_kind_of_model_and_data_class_path_lists_the_valid_ones(args, expected):
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", SYNTHETIC, *args])
    message = one_line(info.value)
    assert expected in message
    kind = "model" if args[0].startswith("--model") else "data"
    valid = ("tasks.LanguageModel", "tasks.TranslationTask") if kind == "model" else (
        "datamodules.SyntheticLM", "datamodules.TextCorpus", "datamodules.KarpathyCaptions")
    assert all(name in message for name in valid) and f"set {kind}.class_path" in message


def test_a_value_of_the_wrong_type_names_key_value_and_type():
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", SYNTHETIC, "--trainer.max_epochs", "three"])
    message = one_line(info.value)
    assert "invalid value 'three' for trainer.max_epochs" in message and "int" in message


def test_an_unknown_init_arg_names_the_class():
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", SYNTHETIC, "--model.init_args.num_heads", "3"])
    assert "model tasks.LanguageModel: Option 'num_heads' is not accepted" in one_line(info.value)


def test_an_unknown_command_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        main(["fitt", "--config", SYNTHETIC])
    assert one_line(info.value) == (
        "unknown command 'fitt': valid commands are fit, validate, test, predict, analyze, bench, convert, demo "
        "(python -m app COMMAND --help)"
    )


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", str(tmp_path / "nowhere.yaml")])
    assert f"config file '{tmp_path / 'nowhere.yaml'}' does not exist" in one_line(info.value)


def test_a_non_utf8_config_file_is_named(tmp_path):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("trainer: {max_epochs: 1}  # réglage\n".encode("latin-1"))
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", SYNTHETIC, "--config", str(config)])
    assert f"config file {config} is not UTF-8 (byte 0xe9" in one_line(info.value)


def recursive_alias(directory: Path) -> tuple[Path, str]:
    path = directory / "recursive.yaml"
    path.write_text("trainer: &a\n  max_epochs: 1\n  x: *a\n")
    return path, "has a recursive alias: *a at line 3 repeats the value &a (line 1) that contains it"


def alias_bomb(directory: Path) -> tuple[Path, str]:
    """Aliases of aliases, ten at each of eight levels: 10**8 values once expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 10)}]" for level in range(1, 9)]
    path = directory / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, "has aliases that expand to more than 100000 values (at *a3, line 5)"


def duplicated_key(directory: Path) -> tuple[Path, str]:
    path = directory / "twice.yaml"
    path.write_text("trainer:\n  max_epochs: 1\n  limit_train_batches: 2\n  max_epochs: 3\n")
    return path, "sets 'trainer.max_epochs' twice (lines 2 and 4), and YAML would silently keep the last"


def fifo(directory: Path) -> tuple[Path, str]:
    path = directory / "pipe.yaml"
    os.mkfifo(path)  # nothing ever writes to it: opening it for reading waits forever
    return path, "is a FIFO (named pipe), not a regular file"


def directory_config(directory: Path) -> tuple[Path, str]:
    path = directory / "configs.yaml"
    path.mkdir()
    return path, "is a directory, not a regular file"


def character_device(directory: Path) -> tuple[Path, str]:
    return Path("/dev/zero"), "is a character device, not a regular file"  # endless zero bytes


CONFIGS_THAT_HANG_OR_LOSE_A_SETTING = [recursive_alias, alias_bomb, duplicated_key, fifo, directory_config, character_device]
#: fit reads --config through the LightningCLI parser, analyze floor (like every tool that rebuilds a
#: checkpoint) through app.checkpoint_io.policy.read_config_files.
CONFIG_READERS = {"fit": ["fit", "--config", SYNTHETIC, "--config"], "analyze": ["analyze", "floor", "--config"]}


@pytest.mark.parametrize("reader", sorted(CONFIG_READERS))
@pytest.mark.parametrize("make", CONFIGS_THAT_HANG_OR_LOSE_A_SETTING, ids=lambda make: make.__name__)
def test_a_config_file_that_would_hang_or_lose_a_setting_is_refused_at_once_in_one_line(tmp_path, make, reader):
    """Each of these once hung the parser (a recursive alias or an alias bomb expanded for ever, a
    FIFO blocked in open) or was read wrongly without a word (the last of two equal keys won)."""
    path, rule = make(tmp_path)
    with time_limit(30):
        done = run_cli([*CONFIG_READERS[reader], str(path)], cwd=tmp_path)
    line = one_error_line(done, f"config file {path} {rule}")
    assert line.endswith(("remove one of them", "such as configs/lm/synthetic.yaml")) or "write the values out" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name] * (path.parent == tmp_path)  # nothing written


#: Option values the parser reads as YAML: inline text, or a YAML file named as the value.
OPTION_VALUES_THAT_HANG_OR_LOSE_A_SETTING = {
    "inline recursive alias": (["--trainer", "&a {max_epochs: 1, x: *a}"], "option --trainer has a recursive alias: *a at line 1"),
    "inline key twice": (["--model.init_args.head={class_path: heads.MoS, class_path: heads.Softmax}"],
                         "option --model.init_args.head sets 'class_path' twice (both on line 1)"),
    "YAML file as a value": ([], "config file {path} has a recursive alias"),
    "FIFO as a value": ([], "--trainer {path} is a FIFO (named pipe), not a regular file or directory"),
}


@pytest.mark.parametrize("case", sorted(OPTION_VALUES_THAT_HANG_OR_LOSE_A_SETTING))
def test_an_option_value_that_would_hang_or_lose_a_setting_is_refused_in_one_line(tmp_path, case):
    """Not only --config: the parser reads an option's inline YAML and a file named as a section's
    value (``--trainer trainer.yaml``) too; each is checked as a config file is, before parsing."""
    options, expected = OPTION_VALUES_THAT_HANG_OR_LOSE_A_SETTING[case]
    if case == "YAML file as a value":
        path, _ = recursive_alias(tmp_path)
        options = ["--trainer", str(path)]
    elif case == "FIFO as a value":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        options = ["--trainer", str(path)]
    with time_limit(30), pytest.raises(ValueError) as info:
        main(["fit", "--config", SYNTHETIC, *options])
    assert one_line(info.value).startswith(expected.format(path=options[-1]))


def test_a_config_whose_aliases_do_not_recurse_is_read(tmp_path):
    config = tmp_path / "aliases.yaml"
    config.write_text("trainer: &limits\n  limit_train_batches: 3\n  limit_val_batches: 3\n"
                      "data:\n  init_args:\n    <<: {batch_size: 7}\n    vocab_size: &size 40\n    bptt: *size\n")
    with time_limit(60):
        done = run_cli(["fit", "--config", SYNTHETIC, "--config", str(config), "--print_config"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "limit_train_batches: 3" in done.stdout and "batch_size: 7" in done.stdout
    assert "vocab_size: 40" in done.stdout and "bptt: 40" in done.stdout


# ---------------------------------------------------------------------------------- output directories
def test_unwritable_log_directory_from_the_shell_is_one_line_and_writes_nothing(tmp_path):
    """The issue's example: `--trainer.logger.init_args.save_dir /proc/forbidden`."""
    if not Path("/proc").is_dir():
        pytest.skip("needs Linux /proc")
    root = tmp_path / "root"
    done = run_cli(["fit", "--config", SYNTHETIC, "--trainer.logger.init_args.save_dir", "/proc/forbidden",
                    "--trainer.default_root_dir", str(root)])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert errors[0] == done.stderr.strip().splitlines()[-1]
    assert errors[0].startswith("error: trainer.logger.init_args.save_dir /proc/forbidden is not writable")
    assert "--trainer.logger.init_args.save_dir" in errors[0].split(";")[-1]
    assert files_under(root) == [] and not Path("/proc/forbidden").exists()


@pytest.mark.parametrize("option", ["--trainer.logger.init_args.save_dir", "--trainer.default_root_dir", "--checkpoint.dirpath"])
def test_a_log_or_checkpoint_directory_under_a_file_is_refused_before_anything_is_written(tmp_path, option):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file where a directory would go\n")
    runs = tmp_path / "runs"
    args = ["fit", "--config", SYNTHETIC, "--trainer.logger.init_args.save_dir", str(runs), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(ValueError) as info:
        main([*args, option, str(blocker / "sub")])
    message = one_line(info.value)
    assert f"{option[2:]} {blocker / 'sub'} cannot be created: {blocker} is a file, not a directory" in message
    assert files_under(tmp_path) == [blocker]


def test_a_read_only_log_directory_is_refused(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes through permission bits; /proc covers the root case")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError) as info:
            main(["fit", "--config", SYNTHETIC, "--trainer.logger.init_args.save_dir", str(locked / "runs"),
                  "--trainer.default_root_dir", str(tmp_path)])
        assert f"cannot create files in {locked} (Permission denied)" in one_line(info.value)
    finally:
        locked.chmod(0o700)


# ---------------------------------------------------------------------------------- hyper-parameters
def test_mitosis_refuses_a_head_whose_expert_count_is_off_its_doubling_path():
    model = ClassificationTask(12, MLPEncoder(8, (16,)), lambda d, v: DSSoftmax(d, v, num_experts=3))
    with pytest.raises(ValueError) as info:
        Mitosis(max_experts=8).on_fit_start(None, model)
    assert "got num_experts=3 and max_experts=8 (set trainer.callbacks.Mitosis.init_args.max_experts to 6, " \
           "or model.init_args.head.init_args.num_experts to 2)" in one_line(info.value)


# ---------------------------------------------------------------------------------- run settings
def tiny_fit(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", *TinyConfig().args("configs/lm/synthetic.yaml", directory=tmp_path), *extra]


@pytest.mark.parametrize(
    "option, value, expected",
    [("--trainer.val_check_interval", "0", "invalid value 0 for trainer.val_check_interval: expected an integer >= 1 "
      "(training batches between validations) or a float in (0, 1] (a fraction of the epoch) "
      "(fix --trainer.val_check_interval or its entry in the config)"),
     ("--trainer.accumulate_grad_batches", "0", "invalid value 0 for trainer.accumulate_grad_batches: expected an "
      "integer >= 1 (batches per optimizer step; 1 accumulates nothing) (fix --trainer.accumulate_grad_batches or its "
      "entry in the config)"),
     ("--trainer.gradient_clip_val", "-1", "invalid value -1 for trainer.gradient_clip_val: expected a finite number "
      ">= 0 (0 or null clips nothing) (fix --trainer.gradient_clip_val or its entry in the config)"),
     ("--seed_everything", "-1", "invalid value -1 for seed_everything: expected an integer in 0..4294967295 (the "
      "range numpy seeds) (fix --seed_everything or its entry in the config)"),
     ("--data.init_args.seed", "-1", "invalid value -1 for data.init_args.seed: expected an integer in 0..4294967295 "
      "(the range numpy seeds) (fix --data.init_args.seed or its entry in the config)"),
     ("--trainer.max_epochs", "0", "invalid value 0 for trainer.max_epochs: expected an integer >= 1, or -1 for no "
      "limit (with trainer.max_steps) (fix --trainer.max_epochs or its entry in the config)")],
    ids=["val-check-interval-0", "accumulate-0", "negative-clip", "negative-seed", "negative-data-seed", "max-epochs-0"],
)
def test_a_run_setting_lightning_would_divide_by_or_ignore_is_refused_before_anything_is_written(tmp_path, option, value, expected):
    """Before: a ZeroDivisionError traceback mid-epoch (0), a silently accepted negative clip, a
    numpy message naming no option (seeds). After: the option's line, and no run directory."""
    result = run_cli(tiny_fit(tmp_path, option, value), tmp_path)
    assert one_error_line(result) == f"error: {expected}"
    assert files_under(tmp_path) == []


def test_an_optimizer_setting_torch_refuses_names_its_key(tmp_path):
    """Before: ``Invalid learning rate: -1.0`` after the data was set up. After: the key, torch's
    reason and the fix, before the run starts."""
    result = run_cli(tiny_fit(tmp_path, "--model.init_args.optimizer.init_args.lr", "-1"), tmp_path)
    assert one_error_line(result) == (
        "error: invalid value -1.0 for model.init_args.optimizer.init_args.lr: Adam refuses it (Invalid learning rate: "
        "-1.0) (fix --model.init_args.optimizer.init_args.lr or its entry in the config)")
    assert files_under(tmp_path) == []


def test_a_batch_too_large_for_memory_is_one_line_naming_the_batch_size(tmp_path):
    """Before: the allocator's RuntimeError traceback. After: the size asked for and the batch-size
    options; the refused run leaves no files. (10**12 rows fail at the first allocation, cheaply.)"""
    result = run_cli(tiny_fit(tmp_path, "--data.init_args.batch_size", str(10**12)), tmp_path)
    one_error_line(result, "error: out of memory during fit: a tensor of ", " could not be allocated; lower "
                   "data.init_args.batch_size (now 1000000000000) or data.init_args.eval_batch_size (now 4), or the "
                   "model's sizes, until a batch fits in memory")
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("kind, what", [
    ("directory", "is a directory, not a regular file"),
    ("fifo", "is a named pipe (FIFO), not a regular file"),
    ("loop", "is a symbolic link that loops back on itself, not a file"),
])
def test_a_corpus_path_that_is_not_a_file_says_what_it_is(tmp_path, kind, what):
    """Before: "is missing" for a directory or a FIFO, a RuntimeError traceback for a link loop.
    After: what is there and how to fix it (a FIFO is never opened: reading one would block)."""
    directory = write_ptb(tmp_path / "ptb")
    train = directory / "ptb.train.txt"
    train.unlink()
    {"directory": train.mkdir, "fifo": lambda: os.mkfifo(train), "loop": lambda: train.symlink_to(train.name)}[kind]()
    result = run_cli(["fit", *TinyConfig().args("configs/lm/ptb.yaml", directory=tmp_path / "out"),
                      "--data.init_args.data_dir", str(directory)], tmp_path)
    assert one_error_line(result) == (
        f"error: TextCorpus('ptb'): {train} {what}; put the corpus text file (one sentence per line) in its place, "
        f"or set data.init_args.data_dir to the corpus")


# ---------------------------------------------------------------------------------- damaged files
def write_ptb(directory: Path, train: bytes | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(f"w{i % 7} w{i % 3} w{i % 5}" for i in range(40)) + "\n"
    for name in ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"):
        (directory / name).write_text(lines)
    if train is not None:
        (directory / "ptb.train.txt").write_bytes(train)
    return directory


def gzip_lines(count: int = 3000) -> bytes:
    return gzip.compress("".join(f"w{i % 7} w{i % 3} w{i % 11}\n" for i in range(count)).encode(), mtime=0)


@pytest.mark.parametrize(
    "damage, reason",
    [(lambda data: data[: len(data) // 2], "Compressed file ended before the end-of-stream marker"),
     (lambda data: data[:-8] + bytes(8), "CRC check failed"),
     (lambda data: data[:2] + b"\x00" + data[3:], "Unknown compression method")],
    ids=["truncated", "bad-checksum", "bad-header"],
)
def test_damaged_gzip_corpus_names_the_file(tmp_path, damage, reason):
    directory = write_ptb(tmp_path / "ptb", train=damage(gzip_lines()))  # gzip found by content, not name
    with pytest.raises(ValueError) as info:
        TextCorpus("ptb", str(directory)).num_classes
    message = one_line(info.value)
    assert f"{directory / 'ptb.train.txt'}: corrupt or truncated gzip file after line" in message
    assert reason in message and "re-download or re-compress it" in message


def parallel_dir(directory: Path, source: bytes | None = None, compress: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        for lang, word in (("xx", "ka"), ("yy", "ko")):
            text = "".join(f"{word}{i % 4} {word}{i % 3}\n" for i in range(12)).encode()
            (directory / f"{split}.{lang}").write_bytes(text)
    if source is not None:
        (directory / "train.xx").unlink()
        (directory / ("train.xx.gz" if compress else "train.xx")).write_bytes(source)
    return directory


def translation(directory: Path, tmp_path: Path) -> TranslationDataModule:
    return TranslationDataModule(source="files", data_dir=str(directory), src_lang="xx", tgt_lang="yy",
                                 tokenizer="word", cache_dir=str(tmp_path / "cache"))


def test_parallel_text_non_utf8_line_names_file_and_line(tmp_path):
    directory = parallel_dir(tmp_path / "p", source=b"ka1 ka2\nka3\nk\xe4se ka1\n" + b"ka1\n" * 9)
    with pytest.raises(ValueError) as info:
        translation(directory, tmp_path).num_classes
    assert f"{directory / 'train.xx'}:3: line is not valid UTF-8 (byte 0xe4 at column 2)" in one_line(info.value)


def test_parallel_text_damaged_gzip_names_the_file(tmp_path):
    directory = parallel_dir(tmp_path / "p", source=gzip_lines(12)[:-5], compress=True)
    with pytest.raises(ValueError) as info:
        translation(directory, tmp_path).num_classes
    assert f"{directory / 'train.xx.gz'}: corrupt or truncated gzip file" in one_line(info.value)


def test_empty_parallel_training_split_is_refused(tmp_path):
    directory = parallel_dir(tmp_path / "p")
    for lang in ("xx", "yy"):
        (directory / f"train.{lang}").write_text("\n\n")
    with pytest.raises(ValueError) as info:
        translation(directory, tmp_path).examples("train")
    assert f"{directory / 'train.xx'} gives no usable train sentences" in one_line(info.value)


def test_missing_parallel_data_directory_says_how_to_get_it(tmp_path):
    data = TranslationDataModule(data_dir=str(tmp_path / "absent"), tokenizer="word", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError) as info:
        data.num_classes
    message = one_line(info.value)
    assert f"no train.de or train.de.gz in {tmp_path / 'absent'}" in message and "download: true" in message


def test_missing_casia_directory_is_one_line(tmp_path):
    with pytest.raises(ValueError) as info:
        gnt_files(tmp_path / "HWDB1.1")
    assert f"CASIA-HWDB directory {tmp_path / 'HWDB1.1'} does not exist (set data.init_args.train_dir" in one_line(info.value)


@pytest.mark.parametrize(
    "content, expected",
    [(b"{\"images\": [", "is not valid JSON (Expecting value at line 1 column 13)"),
     (b"\xff\xfe{}", "is not UTF-8 (byte 0xff at offset 0)"),
     (json.dumps({"images": ["img.jpg"]}).encode(), "image entry 0 is a str, not an object"),
     (json.dumps({"images": [{"filename": 7, "split": "train", "sentences": [], "cocoid": 1}]}).encode(),
      "image entry 0 has a non-string filename 7"),
     (json.dumps({"images": [{"filename": "a.jpg", "split": "train", "sentences": [{"raw": "a dog"}], "cocoid": -4}]}).encode(),
      "image entry 0 has cocoid -4, expected a non-negative integer"),
     (json.dumps({"images": [{"filename": "a.jpg", "split": "train", "sentences": [{"tokens": "a dog"}], "imgid": 0}]}).encode(),
      "image entry 0, sentence 0: expected an object with a string 'raw' and/or a list of string 'tokens'")],
    ids=["truncated-json", "not-utf8", "entry-not-object", "filename-type", "negative-id", "tokens-not-list"],
)
def test_damaged_karpathy_file_is_one_line_naming_it(tmp_path, content, expected):
    path = tmp_path / "dataset_coco.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        KarpathyCaptions(str(path), str(tmp_path)).num_classes
    message = one_line(info.value)
    assert message.startswith(str(path)) and expected in message


def test_read_corpus_of_an_empty_gzip_is_the_empty_corpus_error(tmp_path):
    path = tmp_path / "train.txt.gz"
    path.write_bytes(gzip.compress(b"\n  \n", mtime=0))
    with pytest.raises(ValueError, match=r"corpus file .*train\.txt\.gz is empty \(no non-blank line\)") as info:
        read_corpus(path)
    one_line(info.value)


# ---------------------------------------------------------------------------------- the formatter
def raise_project_error_while_decoding() -> None:
    try:
        b"caf\xe9".decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("corpus.txt:3: line is not valid UTF-8") from None


def test_the_project_message_wins_over_the_library_error_it_replaced():
    """``raise ... from None`` inside ``except UnicodeDecodeError`` keeps the decode error as
    ``__context__``; it is itself a one-line ValueError, and must not be what the user sees."""
    from app.errors import root_user_error

    with pytest.raises(ValueError) as info:
        raise_project_error_while_decoding()
    assert str(root_user_error(info.value)) == "corpus.txt:3: line is not valid UTF-8"
    try:  # a multi-line parser dump wrapping it (jsonargparse raises `from` the constructor's error)
        try:
            raise_project_error_while_decoding()
        except ValueError as error:
            raise ValueError("Does not validate against any of the Union subtypes\n  - ...") from error
    except ValueError as wrapped:
        assert str(root_user_error(wrapped)) == "corpus.txt:3: line is not valid UTF-8"


def test_a_data_loader_worker_error_shows_the_project_message():
    from app.errors import root_user_error

    worker = (f"Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
              f'  File "{ROOT}/datamodules/captioning.py", line 1, in load_image\n    raise ValueError(...)\n'
              f"ValueError: caption image img.png does not exist (check data.init_args.image_root)\n")
    assert str(root_user_error(ValueError(worker))) == "caption image img.png does not exist (check data.init_args.image_root)"


@pytest.mark.parametrize("command", ["predict", "convert export"])
def test_an_output_file_that_is_a_directory_is_refused_before_any_work(command, tmp_path):
    """A result file named by a directory is one line before the model runs (not a traceback
    from the final rename after the whole split was scored)."""
    (tmp_path / "outdir").mkdir()
    fake = tmp_path / "never-read.ckpt"  # refused before the checkpoint is read
    fake.write_bytes(b"not a checkpoint")
    argv = {
        "predict": ["predict", "--config", SYNTHETIC, *TinyConfig().shrink(SYNTHETIC), "--model.init_args.predict_output",
                    str(tmp_path / "outdir"), *TinyConfig.dirs(tmp_path)],
        "convert export": ["convert", "export", "--ckpt_path", str(fake), "--output", str(tmp_path / "outdir"), "--format", "pt2"],
    }[command]
    option = "model.init_args.predict_output" if command == "predict" else "output"
    one_error_line(run_cli(argv, tmp_path), f"{option} {tmp_path / 'outdir'} is a directory: name a file to write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["never-read.ckpt", "outdir"]


# ---------------------------------------------------------------------------------- found by a new user
def test_a_sampling_temperature_that_is_not_positive_is_refused_at_construction(tmp_path):
    """Temperature divides the log-probabilities: 0 was a multinomial traceback, -1 silently
    sampled the inverted distribution. Refused as the model is built, before anything runs."""
    from tasks.language_model import check_sampling_settings

    for value in (-1.0, 0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"LanguageModel needs temperature > 0 \(finite\), got") as info:
            check_sampling_settings(value, 5, 30)
        assert "set model.init_args.temperature" in one_line(info.value)
    with pytest.raises(ValueError, match=r"LanguageModel needs num_samples >= 1, got 0 \(set model.init_args.num_samples\)"):
        check_sampling_settings(1.0, 0, 30)
    argv = ["predict", "--config", SYNTHETIC, *TinyConfig().shrink(SYNTHETIC), "--model.init_args.predict_mode", "sample",
            *TinyConfig.dirs(tmp_path)]
    one_error_line(run_cli([*argv, "--model.init_args.temperature", "-1"], tmp_path),
                   "LanguageModel needs temperature > 0 (finite), got -1.0", "set model.init_args.temperature")
    one_error_line(run_cli([*argv, "--model.init_args.temperature", "0"], tmp_path), "needs temperature > 0 (finite), got 0.0")
    assert files_under(tmp_path) == []


def test_the_character_task_callbacks_on_a_language_model_are_refused_before_training(tmp_path):
    """configs/hanzi/ds8.yaml composed after the LM config lists MisclassifiedImages and
    PredictionWriter, which need a classification task: one line before the first step (it was a
    NotImplementedError after it), naming the callback, the task and the config to use."""
    import lightning.pytorch as pl

    from tasks.callbacks import PredictionWriter

    result = run_cli(["fit", *TinyConfig().args(SYNTHETIC, "configs/hanzi/ds8.yaml", directory=tmp_path)], tmp_path)
    one_error_line(result, "MisclassifiedImages needs a classification task (tasks.ClassificationTask), got LanguageModel",
                   "configs/hanzi/*.yaml are for the character task", "configs/heads/dsN.yaml")
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("events.out.*"))
    with pytest.raises(ValueError, match=r"^PredictionWriter needs a classification task \(tasks.ClassificationTask\), got LightningModule"):
        PredictionWriter().setup(None, pl.LightningModule(), "predict")


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
@pytest.mark.parametrize("command", ["predict", "convert export", "convert ds", "bench infer --json"])
def test_an_output_file_whose_directory_cannot_take_it_is_refused_before_any_work(command, where, tmp_path):
    """``README.md/s.txt`` was a FileExistsError traceback after the samples were printed, and a
    path under /proc a FileNotFoundError: the output path is checked before anything runs."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file\n")
    name = "s.pt2" if command == "convert export" else "s.txt"  # export takes its format from the suffix
    output = str(blocker / name) if where == "under a file" else f"/proc/headbench-nowhere/{name}"
    fake = tmp_path / "never-read.ckpt"  # refused before the checkpoint is read
    fake.write_bytes(b"not a checkpoint")
    argv, option = {
        "predict": (["predict", "--config", SYNTHETIC, *TinyConfig().shrink(SYNTHETIC), "--model.init_args.predict_mode",
                     "sample", "--model.init_args.predict_output", output, *TinyConfig.dirs(tmp_path)],
                    "model.init_args.predict_output"),
        "convert export": (["convert", "export", "--ckpt_path", str(fake), "--output", output, "--format", "pt2"], "output"),
        "convert ds": (["convert", "ds", "--ckpt_path", str(fake), "--output", output], "output"),
        "bench infer --json": (["bench", "infer", "--tiny", "--json", output], "json"),
    }[command]
    reason = f"{blocker} is a file, not a directory" if where == "under a file" else "cannot create files in /proc"
    one_error_line(run_cli(argv, tmp_path), f"{option} {output} cannot be written: {reason}", f"set --{option} to a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["never-read.ckpt", "notes.txt"]


def test_a_prediction_writer_output_path_that_cannot_be_written_is_refused_as_it_is_built(tmp_path):
    from tasks.callbacks import PredictionWriter

    (tmp_path / "notes.txt").write_text("a file\n")
    with pytest.raises(ValueError) as info:
        PredictionWriter(output_path=str(tmp_path / "notes.txt" / "predictions.csv"))
    assert one_line(info.value) == (
        f"PredictionWriter output_path {tmp_path}/notes.txt/predictions.csv cannot be written: {tmp_path}/notes.txt is a file, "
        f"not a directory; set init_args.output_path of tasks.callbacks.PredictionWriter (trainer.callbacks) to a file in a "
        f"directory that exists or can be created"
    )
    with pytest.raises(ValueError, match=r"PredictionWriter output_path .* is a directory: name a file to write"):
        PredictionWriter(output_path=str(tmp_path))
    PredictionWriter(output_path=str(tmp_path / "new" / "predictions.csv"))  # a directory that can be created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("command", ["fit", "test"])
def test_ckpt_path_best_is_one_line_that_says_what_to_pass(command, tmp_path):
    """Lightning's "best" is the best checkpoint of a fit earlier in the same process; its message
    ("ModelCheckpoint is not configured to save the best model") blamed the wrong thing."""
    result = run_cli([command, *TinyConfig().args(SYNTHETIC, directory=tmp_path), "--ckpt_path", "best"], tmp_path)
    if command == "fit":
        one_error_line(result, "--ckpt_path best: fit resumes a run where it stopped, and best checkpoints are for evaluation",
                       "to resume use --ckpt_path last (or the path of a .ckpt file)")
    else:
        one_error_line(result, "--ckpt_path best: test runs in a new process, which has no best checkpoint of its own",
                       "best-epoch=E-step=S.ckpt", "or --ckpt_path last")
    assert "ModelCheckpoint" not in result.stderr
    assert files_under(tmp_path) == []


def test_analyze_experts_writes_beside_the_run_not_into_its_checkpoints_directory(tmp_path, capsys):
    from app.analyze.experts import default_output_dir, main as analyze_experts

    run = tmp_path / "runs" / "X" / "version_0"
    assert default_output_dir(str(run / "checkpoints" / "last.ckpt")) == str(run / "analyze")
    assert default_output_dir(str(tmp_path / "kept" / "ds.ckpt")) == str(tmp_path / "kept")
    with pytest.raises(SystemExit):
        analyze_experts(["--help"])
    assert "runs/X/version_N/analyze for runs/X/version_N/checkpoints/last.ckpt" in " ".join(capsys.readouterr().out.split())


def test_explicit_sizes_win_over_bench_tiny():
    """``bench infer --tiny --num-classes 500 --in-features 32`` ran with d=16, V=300."""
    from app.bench import heads as bench_heads
    from app.bench import infer as bench_infer

    args = bench_infer.parse_args(["--tiny", "--num-classes", "500", "--in-features", "32"])
    assert (args.in_features, args.num_classes, args.samples, args.num_experts) == (32, 500, 20, 8)
    args = bench_infer.parse_args(["--tiny"])
    assert (args.in_features, args.num_classes) == (16, 300)
    assert (bench_infer.parse_args(["--tiny", "--preset", "wmt"]).num_classes) == 300  # tiny is a preset of its own
    args = bench_heads.parse_args(["--tiny", "--vocab", "99"])
    assert (args.vocab, args.tokens) == (99, 24)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_demo_max_epochs_is_refused_under_its_own_name(value):
    result = run_cli(["demo", "--max-epochs", value])
    line = one_error_line(result, f"invalid value {value} for --max-epochs: expected an integer >= 1")
    assert "trainer.max_epochs" not in line.partition("(fix")[0]


@pytest.mark.parametrize("value", ["-3", "0"])
def test_the_plain_pytorch_example_refuses_fewer_than_one_step(value, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plain_pytorch_example", ROOT / "examples" / "plain_pytorch.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit) as stop:
        example.main(["--steps", value])
    assert stop.value.code == 2
    assert f"error: argument --steps: expected an integer >= 1 (optimizer steps per head), got {value}" in capsys.readouterr().err
