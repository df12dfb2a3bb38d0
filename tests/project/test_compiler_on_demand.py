"""The tests' start-up hook (``tests/startup/compiler_on_demand.py``) keeps torch from importing its compiler in
processes that never compile, and changes nothing they compute.

Each case is a real interpreter with or without the hook on its path. The speed-up is the hook's only reason to
exist, so a torch whose optimizers reach the compiler some other way fails here rather than silently making every
replica of the suite 1.3 CPU-seconds slower again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import STARTUP_DIR, TESTS_DIR

#: Two optimizers as a replica uses them (AdamW inside, Nesterov SGD outside), stepped on fixed data; prints the
#: parameters' bytes and whether the compiler got imported. With ``compile``, it then imports the compiler and
#: steps the optimizer from inside a compiled function, as torch's exemption must allow.
TRAIN = """
import json, sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(6):
    optimizer = inner if step % 3 else outer
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
inner.load_state_dict(inner.state_dict())
report = {"params": b"".join(p.detach().numpy().tobytes() for p in model.parameters()).hex(),
          "compiler_imported": "torch._dynamo" in sys.modules}
if "compile" in sys.argv:
    def train_step():
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        return model[0].weight.sum()
    report["compiled_step"] = float(torch.compile(train_step, backend="eager")())
    report["compiler_imported_after"] = "torch._dynamo" in sys.modules
print(json.dumps(report))
"""


def train(*args: str, startup: bool) -> dict[str, object]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if startup:
        env["PYTHONPATH"] = str(STARTUP_DIR)
    done = subprocess.run([sys.executable, "-c", TRAIN, *args], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout)


def test_optimizers_train_the_same_without_importing_the_compiler_and_still_compile_when_asked() -> None:
    hooked = train("compile", startup=True)
    plain = train(startup=False)
    assert plain["compiler_imported"], "torch's optimizers no longer import the compiler: the hook can go"
    assert not hooked["compiler_imported"], "an optimizer imported torch._dynamo despite the start-up hook"
    assert hooked["params"] == plain["params"]
    assert hooked["compiler_imported_after"] and isinstance(hooked["compiled_step"], float)


def test_the_hook_installs_once_through_either_folder_and_a_later_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("print('the later sitecustomize ran')\n")
    code = "import sys; print(sum(getattr(f, 'installed_by_the_tests', False) for f in sys.meta_path))"
    for folders in ([TESTS_DIR], [STARTUP_DIR], [TESTS_DIR, STARTUP_DIR], [STARTUP_DIR, TESTS_DIR]):
        path = os.pathsep.join(str(folder) for folder in [*folders, tmp_path])
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": path}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                              check=True)
        assert done.stdout.splitlines() == ["the later sitecustomize ran", "1"], (path, done.stdout, done.stderr)
