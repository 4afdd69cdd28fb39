"""Shared by the tensor-parallel tests (``test_tensor_parallel.py``, ``test_ray_executor.py``):
a workload that forces preemption and copy-on-write, and the comparison with one rank."""
import pathlib
import time

import pytest

from minipaged import SamplingParams
from tiny_models import pick_prompts

NEW_TOKENS = 10
# Small pools force preemption; "swap" makes the workers swap their blocks out and back in.
ENGINE = dict(block_size=4, num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode="swap",
              seed=0, max_model_len=56)  # (the 14 blocks hold 56 tokens, not the model's 256)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def gone(pids, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def workload(model):
    """Greedy prompts with a clear float64 path, and a seeded n=2 request (copy-on-write)."""
    prompts = pick_prompts(model, [9, 13, 6], NEW_TOKENS)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=NEW_TOKENS,
                             ignore_eos=True, logprobs=3)
    return prompts + [prompts[0][:7]], [greedy] * len(prompts) + [sampled]


def assert_same_outputs(reference, ours):
    assert len(reference) == len(ours)
    for ref, out in zip(reference, ours):
        assert len(ref.outputs) == len(out.outputs)
        for a, b in zip(ref.outputs, out.outputs):
            assert a.token_ids == b.token_ids
            assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-3
            for lp_a, lp_b in zip(a.logprobs, b.logprobs):  # per token: chosen + top 3
                assert lp_a.keys() == lp_b.keys()
                for token in lp_a:
                    assert lp_a[token] == pytest.approx(lp_b[token], abs=1e-4)


def one_rank_and_n_ranks(path: str, model, world_size: int = 2, **engine):
    """(one rank's outputs, ``world_size`` ranks' outputs, the parallel engine's stats) on the
    workload; the parallel engine is shut down afterwards."""
    from minipaged import LLM

    prompts, params = workload(model)
    engine = {**ENGINE, **engine}
    reference = LLM(path, **engine).generate(prompt_token_ids=prompts, sampling_params=params,
                                             use_tqdm=False)
    parallel = LLM(path, tensor_parallel_size=world_size, **engine)
    try:
        outputs = parallel.generate(prompt_token_ids=prompts, sampling_params=params,
                                    use_tqdm=False)
    finally:
        parallel.llm_engine.shutdown()
    return reference, outputs, parallel.llm_engine.stats

# -- what a worker imports -------------------------------------------------------------------------
def package_names() -> list[str]:
    """The names of minipaged's subpackages (``kernels``, ``models``, ``core``, ...), and of its
    top-level modules: each would also be a top-level module in a process that had the
    ``minipaged/`` folder itself on its path."""
    import minipaged

    folder = pathlib.Path(minipaged.__file__).parent
    subpackages = [p.parent.name for p in folder.glob("*/__init__.py")]
    modules = [p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")]
    return sorted(subpackages + modules)


def fake_top_level_modules(folder: pathlib.Path) -> pathlib.Path:
    """A top-level package named like each of minipaged's, in ``folder``; each raises on import
    (a worker that imports one has the wrong path)."""
    for name in package_names():
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('the fake top-level {name!r} of the test was imported')\n")
    return folder


def where_names_resolve() -> dict:
    """Run in a worker: where each of minipaged's names would be imported from as a top-level
    module (None: nowhere), and the process's sys.path."""
    import importlib.util
    import sys

    found = {}
    for name in package_names():
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        found[name] = None if spec is None else (
            spec.origin or next(iter(spec.submodule_search_locations or []), None))
    return {"names": found, "sys_path": list(sys.path)}


def inside_the_package(resolved: dict) -> list[str]:
    """The names of ``where_names_resolve``'s answer that resolve inside minipaged's folder, and
    the path entries inside it."""
    import minipaged

    folder = str(pathlib.Path(minipaged.__file__).parent.resolve())
    inside = lambda p: p is not None and str(pathlib.Path(p).resolve()).startswith(folder)  # noqa: E731
    return ([n for n, where in resolved["names"].items() if inside(where)]
            + [p for p in resolved["sys_path"] if p and inside(p)])
