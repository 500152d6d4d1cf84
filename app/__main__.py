import os

# Transparent huge pages for PyTorch's large CPU tensors (c10 reads this once, before the first
# allocation): a training step allocates and frees tens of MiB of activations, and with 4 KiB pages
# their page faults are a measurable part of a step (docs/benchmarks.md). Set it to 0 to
# opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from app.main import run  # noqa: E402

run()
