"""``pip install dcp_nvme`` into an environment that already holds a torch keeps that torch: the
package's torch requirement (``pyproject.toml``) is met by every release the suite runs on, so pip
neither up- nor downgrades it. Checked on the torch this suite runs under (2.13, 2.14 or 2.15:
``bash scripts/dev.sh test --torch 2.15``), in a fresh venv that sees the suite's packages, as a
training environment has its own, and no package index (nothing may need to be fetched)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from dcp_nvme import compat

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pip_install_into_an_environment_with_torch_keeps_its_torch(tmp_path):
    source = tmp_path / "src"  # what the build reads, copied: no build/ or egg-info in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "dcp_nvme", source / "dcp_nvme", ignore=shutil.ignore_patterns("__pycache__"))
    # the checkout off the path, and this machine's pip settings (its constraints cap torch) out:
    # what is checked is the package's own requirement
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    clean["PIP_CONFIG_FILE"] = os.devnull
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    # the training environment: the suite's packages (torch among them) visible to the new venv
    code = "import site, sys; print(site.getsitepackages()[0])"
    target = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, env=clean).stdout.strip()
    (Path(target) / "training_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    # what pip sees, without importing torch: its version and where it is installed
    probe = ("import json, importlib.metadata as m, importlib.util as u; d = m.distribution('torch'); "
             "print(json.dumps([d.version, str(d.locate_file('')), u.find_spec('torch').origin]))")
    before = json.loads(subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                                       check=True, timeout=120, env=clean).stdout)
    assert before[0] == importlib.metadata.version("torch") and Path(before[2]) == Path(torch.__file__), before

    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                           "--no-build-isolation", "--no-cache-dir", "--no-compile", str(source)],
                          capture_output=True, text=True, timeout=300, env=clean)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    installed = done.stdout.rsplit("Successfully installed", 1)[-1].split()
    assert [name.rsplit("-", 1)[0] for name in installed] == ["dcp_nvme"], done.stdout[-2000:]

    after = json.loads(subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                                      check=True, timeout=120, env=clean).stdout)
    assert after == before, f"pip install dcp_nvme replaced torch {before} with {after}"
    code = ("import json, importlib.metadata as m, importlib.util as u; "
            "print(json.dumps([u.find_spec('dcp_nvme').origin, m.requires('dcp_nvme')]))")
    where, requires = json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                                                check=True, timeout=120, cwd=tmp_path, env=clean).stdout)
    assert Path(where).is_relative_to(env), where
    assert f"torch>={compat.MIN_TORCH}" in requires, requires
