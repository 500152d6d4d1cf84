"""``heads`` is pure PyTorch: importing it, building every registered head, one optimizer step,
``topk``, and DS-Softmax's mitosis and pruning load no Lightning module and none of the
optional libraries (numpy, which torch does not require, scipy, matplotlib, torchvision); a
LightRNN reallocation, which solves a matching with numpy and scipy, still loads no Lightning.

One fresh process, so what other tests imported cannot hide an import."""

from __future__ import annotations

import subprocess
import sys

from tests.shell import ENV, ROOT

SCRIPT = r"""
import sys

import torch

import heads
from heads import available_heads, create_head

torch.manual_seed(0)
D, V = 8, 30
built = []
for name in available_heads():
    head = create_head(name, in_features=D, num_classes=V)
    hidden, target = torch.randn(12, D), torch.randint(0, V, (12,))
    params = [p for p in head.parameters() if p.requires_grad]
    if params:  # SVD-softmax is an inference baseline over a trained softmax: nothing to train
        optimizer = torch.optim.Adam(params, lr=1e-2)
        loss = head(hidden, target).mean() + sum(head.regularization().values())
        loss.backward()
        optimizer.step()
        head.after_optimizer_step(optimizer)
    else:
        assert torch.isfinite(head(hidden, target)).all(), name
    values, indices = head.eval().topk(hidden, 3)
    assert values.shape == indices.shape == (12, 3), (name, values.shape)
    built.append(name)

ds = heads.DSSoftmax(D, V, num_experts=2, group_lasso_weight=1e-3)
optimizer = torch.optim.Adam(ds.parameters(), lr=1e-2)
ds.clone_experts(0.01, optimizers=[optimizer])
ds.prune(0.5, optimizers=[optimizer])
assert ds.num_experts == 4 and ds.expert_weight.shape[0] < 4 * V

def loaded(names):
    return ",".join(sorted({m.split(".")[0] for m in sys.modules} & set(names)))

print("built", ",".join(built))
print("loaded", loaded(("lightning", "pytorch_lightning", "scipy", "matplotlib", "torchvision")))
# numpy (which torch does not require) is needed by the LightRNN table reallocation only
print("numpy_users", ",".join(m for m in sys.modules if m == "heads.lightrnn.allocation"))

# A LightRNN table-learning step solves a matching: that one needs numpy and scipy, still no Lightning.
lightrnn = heads.HybridLightRNN(D, V)
lightrnn.collect_costs()
lightrnn(torch.randn(12, D), torch.randint(0, V, (12,)))
assert lightrnn.reallocate() is not None
print("after_reallocation", loaded(("lightning", "pytorch_lightning")))
"""


def test_heads_train_and_answer_without_lightning_or_optional_libraries():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env={**ENV, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in result.stdout.splitlines())
    import heads

    assert lines["built"].split(",") == heads.available_heads(), result.stdout
    assert lines["loaded"] == "", f"importing and training heads loaded: {lines['loaded']}"
    assert lines["numpy_users"] == "", "building and training heads imported the numpy-based table reallocation"
    assert lines["after_reallocation"] == "", f"a LightRNN reallocation loaded: {lines['after_reallocation']}"
