"""``make gpu-check``'s plumbing, checked without a GPU (scripts/gpu_check.sh).

The stages themselves need CUDA; what must hold everywhere: the stages' time limits add up to
eight minutes with their grace, each stage has its own log, a failing or overrunning stage does not
stop the next, and the summary table gives each stage's exit status and seconds.
"""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GRACE_S = 5  # timeout --kill-after, per stage


def run(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def summary_rows(text: str) -> list[list[str]]:
    table = text.split("gpu-check summary")[1].splitlines()[2:]
    return [line.split() for line in table if line.strip()]


@pytest.mark.parametrize("script", ["gpu_check.sh", "carry_embedded.sh"])
def test_the_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0


def test_the_plan_fits_eight_minutes_in_the_stage_order(tmp_path):
    done = run("--dry-run", env={"OUT": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    rows = summary_rows(done.stdout)
    names = [r[1] for r in rows]
    assert names == ["compiled-ops", "tests-gpu", "kernel-bench", "throughput-gpt2",
                     "profile-decode", "like-for-like", "embedded-vs-hf", "kernel-grid"]
    limits = [int(r[2]) for r in rows]
    assert sum(limits) + GRACE_S * len(limits) <= 8 * 60
    for r in rows:  # each stage logged under $OUT, where the device runner fetches it
        log = Path(r[5])
        assert log.parent == tmp_path / "gpu-check" and log.exists()
        assert "dry run, would run:" in log.read_text()
    plan = done.stdout
    assert "--num-requests 200" in plan and "--num-requests 1000" not in plan
    assert "benchmarks/kernel.py --quick" in plan
    assert "benchmarks/kernel.py --grid" in plan  # its own stage, warm and cold
    assert "benchmarks/like_for_like.py --device cuda" in plan


def test_a_failing_or_overrunning_stage_does_not_stop_the_next(tmp_path):
    stages = tmp_path / "stages"
    stages.write_text("first|5|echo fine\n"
                      "broken|5|echo about to fail; exit 3\n"
                      "slow|1|sleep 30\n"
                      "missing|5|echo skip: nothing carried; exit 99\n"
                      "last|5|echo still ran\n")
    done = run(env={"GPU_CHECK_STAGES": str(stages), "GPU_CHECK_LOGS": str(tmp_path / "logs")})
    assert done.returncode == 1  # some stage failed
    rows = {r[1]: r for r in summary_rows(done.stdout)}
    assert [rows[n][3] for n in ("first", "broken", "slow", "missing", "last")] == [
        "0", "3", "124", "skip", "0"]
    assert float(rows["slow"][4]) < 1 + GRACE_S + 2  # stopped at its limit, not after 30 s
    assert (tmp_path / "logs" / "5-last.log").read_text() == "still ran\n"
    assert "about to fail" in (tmp_path / "logs" / "2-broken.log").read_text()
    assert (tmp_path / "logs" / "summary.txt").read_text().count("\n") == 6


def test_only_runs_the_stages_named(tmp_path):
    done = run("--dry-run", "--only", "3,5", env={"GPU_CHECK_LOGS": str(tmp_path)})
    assert [r[1] for r in summary_rows(done.stdout)] == ["kernel-bench", "profile-decode"]
    assert re.search(r"unknown argument", run("--bogus").stderr)


@pytest.mark.slow  # (8 s)
def test_the_decode_profile_runs_small_on_the_cpu():
    """Stage 5's script, on a CPU and a 1-layer model: the step, the floor, multi-step decode's
    step and the top-20 table."""
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_decode.py"),
                           "--device", "cpu", "--hidden", "256", "--layers", "1", "--batch", "2",
                           "--prompt-len", "16"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"decode step of 2 sequences at ~\d+ tokens \(eager\): [\d.]+ ms",
                     done.stdout)
    assert "x the weight floor" in done.stdout
    # the matmuls are a row of the table by whichever routine ran them: torch's, or the C++ op's
    # few-row one (named there while the profiler runs)
    assert re.search(r"aten::mm|aten::addmm|mkldnn|minipaged_cpu::linear", done.stdout), \
        done.stdout[-3000:]
    assert re.search(r"by section .*schedule [\d.]+, prepare [\d.]+, model [\d.]+", done.stdout)
    assert re.search(r"q/k/v [\d.]+ vs [\d.]+; gate/up [\d.]+ vs [\d.]+", done.stdout)
    # multi-step decode (--multi-steps 8 by default): every timed step() ran 8 decode steps
    multi = re.search(r"multi-step decode \(num_scheduler_steps=8\): ([\d.]+) ms per decode step "
                      r"vs ([\d.]+) ms single-step \(([\d.]+)x the weight floor, single-step "
                      r"([\d.]+)x\); (\d+) decode steps in (\d+) step\(\) calls", done.stdout)
    assert multi, done.stdout[-3000:]
    ms, single, floors, single_floors = map(float, multi.groups()[:4])
    assert ms > 0 and single > 0 and floors > 0
    assert floors / single_floors == pytest.approx(ms / single, rel=0.05)  # (rounded to 0.01)
    decodes, calls = map(int, multi.groups()[4:])
    assert calls >= 3 and decodes == 8 * calls
    assert "did not engage" not in done.stdout and "failed" not in done.stdout
