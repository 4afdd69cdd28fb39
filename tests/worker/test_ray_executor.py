"""Tensor parallelism on a Ray cluster (lesson 14): the ranks as Ray actors, one per node of a
simulated multi-node cluster, give the tokens and logprobs of one process.

One cluster for the whole module (Ray's own ``ray.cluster_utils.Cluster``: three nodes of one
CPU each, all on 127.0.0.1, no dashboard), since starting one takes 20-60 s on two busy cores. A
rank's bundle is one CPU, so PACK puts one rank on each node, and every test shuts its engine
down (the cluster has room for one engine at a time). The cluster is always shut down, and no
process of it may be left.

Slow: more than 140 s on the 2-core machine (12 of its tests took 140 s at load ~9).
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from minipaged import LLM, SamplingParams
from minipaged.lab.ray_cluster import LOOPBACK
from minipaged.worker.ray_workers import actor_runtime_env
from minipaged.worker.tensor_parallel import WorkerError, shard_weight_bytes
from repo_paths import ROOT
from tiny_models import save_tiny_model
from tp_helpers import (ENGINE, assert_same_outputs, fake_top_level_modules, gone,
                        inside_the_package, one_rank_and_n_ranks, where_names_resolve,
                        workload)

pytestmark = [pytest.mark.lesson14, pytest.mark.slow]
RAY = dict(distributed_executor_backend="ray")


def _import_ray():
    try:
        import ray
    except ImportError:
        pytest.skip("Ray is not installed (pip install 'minipaged[ray]')")
    return ray


@pytest.fixture(scope="module")
def cluster():
    _import_ray()
    from minipaged.lab.ray_cluster import simulated_cluster

    with simulated_cluster(num_nodes=3) as started:
        yield started
    assert started.left_behind == [], "processes of the Ray cluster were left behind"


def _leftovers(ray) -> tuple[list, list]:
    """(actors not dead, placement groups not removed) on the cluster."""
    actors = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return actors, groups


def _no_leftovers(ray, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while _leftovers(ray) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _leftovers(ray) == ([], [])


@pytest.fixture(scope="module")
def gpt2_6_heads(tmp_path_factory):
    """GPT-2 with 6 heads: N = 2 and N = 3 both split it."""
    path = tmp_path_factory.mktemp("ray_gpt2")
    return str(path), save_tiny_model("gpt2", path, n_head=6, n_embd=96)


@pytest.fixture(scope="module")
def llama_12_heads(tmp_path_factory):
    """LLaMA with 12 heads and 6 kv heads (grouped-query attention): N = 2 and N = 3 split it."""
    path = tmp_path_factory.mktemp("ray_llama")
    return str(path), save_tiny_model("llama", path, hidden_size=96, intermediate_size=192,
                                      num_attention_heads=12, num_key_value_heads=6)


# -- no cluster --------------------------------------------------------------------------------
def test_without_ray_the_backend_is_a_clear_error_naming_the_extra(monkeypatch, tiny_llama):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ValueError, match=r"needs Ray.*pip install 'minipaged\[ray\]'"):
        LLM(tiny_llama[0], tensor_parallel_size=2, **RAY)
    from minipaged.worker.ray_workers import import_ray

    with pytest.raises(ValueError, match=r"pip install 'minipaged\[ray\]'"):
        import_ray()


def test_an_unknown_backend_is_refused_naming_the_field(tiny_llama):
    with pytest.raises(ValueError, match="distributed_executor_backend must be None, 'mp' or "
                                         "'ray'.*got 'slurm'"):
        LLM(tiny_llama[0], tensor_parallel_size=2, distributed_executor_backend="slurm")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_cli_flag_reaches_the_engine(monkeypatch, capsys, command):
    import functools

    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints import cli

    seen = {}

    @functools.wraps(LLMEngine.__init__)  # (the CLI reads the defaults from its signature)
    def stop_at_the_engine(self, model=None, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped here")

    monkeypatch.setattr(LLMEngine, "__init__", stop_at_the_engine)
    argv = [command] + (["hello"] if command == "generate" else []) + [
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    assert cli.main(argv) == 2 and "stopped here" in capsys.readouterr().err
    assert seen["distributed_executor_backend"] == "ray" and seen["tensor_parallel_size"] == 2
    with pytest.raises(SystemExit):
        cli.main(argv[:-1] + ["slurm"])
    assert "invalid choice: 'slurm'" in capsys.readouterr().err


# -- on the simulated cluster ------------------------------------------------------------------
def test_the_cluster_is_three_nodes_on_the_loopback_only(cluster):
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 3
    assert {n["NodeManagerAddress"] for n in nodes} == {LOOPBACK}
    assert cluster.address.startswith(LOOPBACK + ":")  # the GCS


_REFERENCES = {}  # (model, engine settings) -> one rank's outputs


@pytest.mark.parametrize("kind,world_size,preemption_mode", [
    ("gpt2", 3, "swap"), ("gpt2", 2, "recompute"), ("llama", 2, "swap"),
    ("llama", 3, "recompute")])
def test_ranks_on_separate_nodes_match_one_rank(cluster, gpt2_6_heads, llama_12_heads, kind,
                                                world_size, preemption_mode):
    import ray

    path, model = gpt2_6_heads if kind == "gpt2" else llama_12_heads
    prompts, params = workload(model)
    engine = {**ENGINE, "preemption_mode": preemption_mode}
    key = (kind, preemption_mode)
    if key not in _REFERENCES:
        single = LLM(path, **engine)
        _REFERENCES[key] = (single.generate(prompt_token_ids=prompts, sampling_params=params,
                                            use_tqdm=False), single.llm_engine.stats.num_steps)
    reference, reference_steps = _REFERENCES[key]

    parallel = LLM(path, tensor_parallel_size=world_size, **RAY, **engine)
    try:
        outputs = parallel.generate(prompt_token_ids=prompts, sampling_params=params,
                                    use_tqdm=False)
        workers = parallel.llm_engine.worker
        placement = workers.placement
        memory = workers.memory_per_rank()
        stats = parallel.llm_engine.stats
    finally:
        parallel.llm_engine.shutdown()
    assert_same_outputs(reference, outputs)
    if preemption_mode == "swap":
        assert stats.num_preemptions_swap > 0 and stats.num_blocks_swapped_in > 0
    else:
        assert stats.num_preemptions_recompute > 0
    assert stats.num_blocks_copied > 0 and stats.num_steps == reference_steps
    # one rank on each node, every one on the loopback
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len({p["node_id"] for p in placement}) == world_size
    assert {p["node_id"] for p in placement} <= nodes
    assert {p["ip"] for p in placement} == {LOOPBACK}
    config = parallel.llm_engine.hf_config
    assert [m["weights"] for m in memory] == [shard_weight_bytes(config, world_size, r)
                                              for r in range(world_size)]
    assert _no_leftovers(ray), _leftovers(ray)


def test_actors_import_what_the_driver_imports(cluster, tiny_llama, tmp_path, monkeypatch):
    """A top-level package named like each of minipaged's on the driver's path changes nothing:
    the actors load and match one rank, and no name resolves inside the package's folder there
    (``test_worker_imports.py`` checks the same for worker processes)."""
    import ray

    path, model = tiny_llama
    monkeypatch.setattr(sys, "path", sys.path + [str(fake_top_level_modules(tmp_path))])
    reference, outputs, _ = one_rank_and_n_ranks(path, model, 2, **RAY)
    assert_same_outputs(reference, outputs)
    probe = ray.remote(num_cpus=0)(where_names_resolve).options(
        runtime_env=actor_runtime_env())  # a task started as the actors are
    seen = ray.get(probe.remote(), timeout=120)
    assert inside_the_package(seen) == []  # no name of ours is a top-level module there
    assert _no_leftovers(ray), _leftovers(ray)


def test_a_killed_actor_raises_naming_its_rank_and_nothing_is_left(cluster, tiny_llama):
    import ray

    prompts, params = workload(tiny_llama[1])
    parallel = LLM(tiny_llama[0], tensor_parallel_size=2, **RAY, **ENGINE)
    workers = parallel.llm_engine.worker
    ray.kill(workers.actors[1])
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(Ray actor on node 127\.0\.0\.1 .*died"):
        parallel.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert time.monotonic() - start < 15
    assert _no_leftovers(ray), _leftovers(ray)  # rank 0 killed too, the placement group gone
    with pytest.raises(WorkerError, match="stopped after an error"):
        parallel.generate(prompt_token_ids=prompts[:1], sampling_params=params[:1],
                          use_tqdm=False)


def test_a_hung_actor_times_out_and_is_stopped(cluster, tiny_llama):
    import ray

    prompts, params = workload(tiny_llama[1])
    parallel = LLM(tiny_llama[0], tensor_parallel_size=2, **RAY, **ENGINE)
    workers = parallel.llm_engine.worker
    workers.timeout = 3.0  # (after the start: loading may take longer on a busy machine)
    pids = [p["pid"] for p in workers.placement]
    os.kill(pids[0], signal.SIGSTOP)  # alive, but never answers
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank\(s\) \[0(, 1)?\] did not answer within 3 s"):
            parallel.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert time.monotonic() - start < 15
        assert gone(pids, within=20)  # the stopped process too
        assert _no_leftovers(ray), _leftovers(ray)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_actors_end_with_the_interpreter(cluster, tiny_llama):
    """A script that never shuts its engine down leaves no actor or placement group behind."""
    import ray

    script = ("import sys; from minipaged import LLM; "
              "llm = LLM(sys.argv[1], tensor_parallel_size=2, "
              "distributed_executor_backend='ray'); "
              "print(*[p['pid'] for p in llm.llm_engine.worker.placement], flush=True)")
    env = dict(os.environ, RAY_ADDRESS=cluster.address,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script, tiny_llama[0]], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2 and gone(pids, within=20)
    assert _no_leftovers(ray), _leftovers(ray)


def test_serve_with_the_ray_backend_answers_the_openai_client(cluster, tmp_path):
    import openai
    import ray

    from serving_helpers import running_server_process, save_tiny_model_with_tokenizer

    save_tiny_model_with_tokenizer(tmp_path)
    flags = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
             "--num-gpu-blocks", "64", "--max-model-len", "128"]
    prompt = "The capital of France is"
    expected = LLM(str(tmp_path), num_gpu_blocks=64, max_model_len=128).generate(
        prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    with running_server_process(str(tmp_path), *flags, name="tiny",
                                log_path=tmp_path / "serve.log",
                                env={"RAY_ADDRESS": cluster.address}) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert _leftovers(ray)[0]  # the server's two actors
    assert answer.choices[0].text == expected
    assert _no_leftovers(ray), _leftovers(ray)
