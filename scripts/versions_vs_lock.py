"""The versions this machine has next to the lock's (README, "The lock"): a GPU machine has its
own python3 and no registry, so `make gpu-check` installs nothing and says what differs instead.

    python3 scripts/versions_vs_lock.py requirements/lock-cuda.txt [package ...]

Prints one line per package (every locked one when none is named) whose installed version is
not the locked one, then a count; always exits 0 (the difference is information, not a failure).
"""
import importlib.metadata
import re
import sys


def locked(path: str) -> dict[str, str]:
    pins = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.split(";")[0].strip()
    return pins


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-3], file=sys.stderr)
        return 2
    pins = locked(argv[0])
    names = [re.sub(r"[-_.]+", "-", n).lower() for n in argv[1:]] or sorted(pins)
    differ = 0
    for name in names:
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "not installed"
        want = pins.get(name, "not locked")
        if have != want:
            differ += 1
            print(f"versions: {name}: this machine {have}, the lock {want}")
    print(f"versions: {differ} of {len(names)} package(s) differ from {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
