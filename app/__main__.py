import os

# Transparent huge pages for PyTorch's large CPU tensors (c10 reads this once, before the first
# allocation): a training step allocates and frees tens of MiB of activations, and with 4 KiB pages
# the page faults alone cost ~20% of a softmax step here (docs/benchmarks.md). Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from app.cli import run  # noqa: E402

run()
