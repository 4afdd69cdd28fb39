"""Decode-attention kernel benchmark (lesson 05): how close does paged attention get to the
memory bandwidth of the GPU?

Decode attention reads every cached key and value once and does little arithmetic on them, so
its speed limit is memory bandwidth. For each batch size and context length this script times

  v1, v2    our CUDA kernels (minipaged.kernels.cuda_kernels), reading K/V through block
            tables: V1 one CUDA block per (head, sequence), V2 also split into 512-token
            partitions
  auto      what the launcher runs for that batch (version 0): V1, or V2 with partitions of 64
            to 512 tokens (shorter when few sequences run); `plan` names it (V2/64: 64 tokens)
  gather    the torch reference idea: gather the blocks into dense tensors, then SDPA
  sdpa      torch SDPA over a contiguous (unpaged) cache of the same size: what paging costs

and reports the achieved bandwidth of the chosen kernel (bytes of K/V it must read / time) as a
fraction of a device-to-device copy measured on the same GPU (counting bytes read and written).
Before timing, each kernel's output is checked against minipaged.kernels.reference on the first
sequences of the batch (the script stops on a mismatch: a fast wrong kernel is no result).

Setup: head size 128, 32 query heads and 32 kv heads (a LLaMA-7B layer), fp16, block size 16,
physical blocks shuffled. Times are medians of CUDA-event measurements after a warm-up, of a CUDA
graph that replays one call per input copy (at least 10; as the engine replays its decode
step): a call's host-side work (argument checks, the launch) would otherwise be timed too, and
at batch 1 it takes longer than the kernel. --eager times plain calls instead. Every case
rotates through enough copies of its inputs that one pass over them touches more than twice the
GPU's L2 cache (its size as torch reports it, else the 50 MB of an H100), so that no case, however
small, is served from L2; a case whose copies would not fit in memory is capped, with a warning.

    PYTHONPATH=. python3 benchmarks/kernel.py [--quick] [--eager] [--partitions] [--gqa | --grid]

--partitions adds a table for small batches: V2 with each forced partition size (64 to 512
tokens) next to the automatic plan; for batch 1 also the same with the fused reduce (fused/64 ..
fused/512, fused auto: the partitions' last CUDA block combines them, no second kernel; off by
default until these columns are measured, see docs/ARCHITECTURE.md).

A second table (--gqa for it alone) takes grouped-query attention, 32 query heads on 8 kv heads
(a LLaMA-3 8B layer): today's per-head kernels (V1, V2: each kv head read once per query head,
4 times) next to the grouped kernel (version 3: once per group), with the K/V bytes each reads.

--grid prints only the kernel grid (gpu-check stage 8), every case both warm and cold: 32 query
heads on 8 kv heads (the grouped kernel V3 and the automatic plan, version 0) and 32 on 32 (the
automatic plan), head size 128, block size 16, fp16 and bf16, batch 1, 8 and 64, contexts
1,024, 4,096 and 16,384. Warm replays calls on one input copy, so K/V that fits in L2 may be
read from it (copy 0 of the cold pool: the other copies' blocks lie around it unread); cold
rotates through copies until one pass touches more than 4 x L2 (GRID_L2_FACTOR). A case whose
one copy already passes 4 x L2 (64 x 16,384 MHA fp16 is 17 GB) has one copy: warm and cold are
then one measurement, timed once ("same as warm"). Above the table: the card, its L2 and where
the size comes from, the copy bandwidth, graph replays or eager; each row gives the cold copies,
and time, TB/s (K/V bytes the kernel must read, each kv head once, / time) and the fraction of
the copy, warm and cold. Each kernel is checked against the reference before it is timed (bf16
within 1e-2, fp16 2e-3). Budget: grid_time_estimate() gives about 20 s on an H100 or H200
(10 s of start-up, 0.1 s of host work per measurement, over twice what stage 3's measurements
took, and every kernel call at 2.5 TB/s); to keep that, calls reading at least 1 GiB are timed
over 5 replays instead of 15 (fp16 and bf16 both stay).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minipaged.model_shape import kv_bytes_per_token  # noqa: E402

HEAD_SIZE = 128
NUM_HEADS = 32
NUM_KV_HEADS = 32
BLOCK_SIZE = 16
DTYPE = torch.float16
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [128, 512, 1024, 2048, 4096, 16384]
DEFAULT_L2_BYTES = 50 * 10**6  # an H100's L2, assumed where torch does not report the size
L2_FACTOR = 2  # one pass over a case's input copies touches more than this many L2s
MAX_ROTATION_BYTES = 8 * 2**30  # at most this much K/V in one case's copies (then: a warning)
BASELINE_LIMIT = 4 * 2**30  # skip the gather baseline above this many K/V bytes (it copies them)


USE_GRAPHS = True  # --eager sets False


def capture(fn, num_inputs: int, calls: int):
    """A CUDA graph of ``calls`` calls of ``fn`` over the input copies, or None (with a note)
    when something in ``fn`` cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn(0)  # one more warm-up on the capture stream
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for k in range(calls):
                    fn(k % num_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        return graph
    except RuntimeError as error:
        torch.cuda.synchronize()
        print(f"(not capturable, timed eagerly: {str(error).splitlines()[0][:100]})", flush=True)
        return None


def time_ms(fn, num_inputs: int, rounds: int = 15, calls_per_round: int = 10) -> float:
    """Median time of one call, in milliseconds; ``fn(i)`` runs on input copy ``i``.

    With ``USE_GRAPHS`` the calls are captured once in a CUDA graph (``calls_per_round`` calls
    over the input copies) and the graph is replayed, so that host-side overheads are not timed.
    """
    for i in range(3):  # warm-up (and the first call's one-time work)
        fn(i % num_inputs)
    torch.cuda.synchronize()
    # one replay calls fn on every input copy at least once: it touches more than 2 x L2
    calls = max(calls_per_round, num_inputs)
    graph = capture(fn, num_inputs, calls) if USE_GRAPHS else None
    if graph is not None:
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        del graph
        return statistics.median(times)
    times = []
    call = 0
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_round):
            fn(call % num_inputs)
            call += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_round)
    return statistics.median(times)


def l2_cache_bytes(device: int = 0) -> tuple[int, str]:
    """The GPU's L2 cache size in bytes, and where the number comes from."""
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    if size > 0:
        return int(size), "reported by the device"
    return DEFAULT_L2_BYTES, "assumed: torch does not report it"


def rotation_copies(bytes_per_copy: int, l2_bytes: int, factor: int = L2_FACTOR,
                    max_bytes: int = MAX_ROTATION_BYTES) -> tuple[int, str | None]:
    """How many copies of a case's inputs to rotate through, and a warning or None.

    A timed call reads one copy (``bytes_per_copy``); the next call reads the next copy, so one
    pass over ``copies`` copies touches ``copies * bytes_per_copy`` bytes, which must exceed
    ``factor * l2_bytes`` for every read to come from memory, not from L2. The copies are capped
    at ``max_bytes`` of memory: then the warning says that this case may be partly served by L2.
    """
    wanted = factor * l2_bytes // bytes_per_copy + 1  # the fewest copies past factor x L2
    cap = max(1, max_bytes // bytes_per_copy)
    if wanted <= cap:
        return wanted, None
    return cap, (f"warning: {cap} copies of {bytes_per_copy / 1e6:.1f} MB (the memory cap, "
                 f"{max_bytes / 2**30:.0f} GiB) touch {cap * bytes_per_copy / 1e6:.0f} MB per "
                 f"pass, under {factor} x the {l2_bytes / 1e6:.0f} MB L2: this case may be "
                 "partly served from L2")


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # Timed eagerly: the same copy captured in a CUDA graph (a memcpy node, which the driver may
    # hand to a copy engine) measured 2.76 TB/s on an H200, where eager copies measure 4.2.
    global USE_GRAPHS
    graphs, USE_GRAPHS = USE_GRAPHS, False
    try:
        ms = time_ms(lambda i: dst.copy_(src), 1, rounds=10, calls_per_round=5)
    finally:
        USE_GRAPHS = graphs
    return 2 * n / (ms * 1e-3)


def paged_inputs(batch: int, context: int, copies: int, num_kv_heads: int = NUM_KV_HEADS,
                 dtype: torch.dtype = DTYPE):
    """A shuffled pool of `copies` independent batches: (queries [copies, batch, heads, D],
    key_cache, value_cache, tables [copies, batch, blocks], context_lens, scale)."""
    x = 16 // dtype.itemsize
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = copies * batch * blocks_per_seq
    key_cache = torch.empty(num_blocks, num_kv_heads, HEAD_SIZE // x, BLOCK_SIZE, x,
                            dtype=dtype, device="cuda").normal_()
    value_cache = torch.empty(num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE,
                              dtype=dtype, device="cuda").normal_()
    pool = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = pool.view(copies, batch, blocks_per_seq)  # copy c reads its own blocks
    queries = torch.randn(copies, batch, NUM_HEADS, HEAD_SIZE, dtype=dtype, device="cuda")
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return queries, key_cache, value_cache, tables, context_lens, HEAD_SIZE ** -0.5


def time_versions(kernels, inputs, context: int, copies: int, versions) -> dict:
    """``v{version}_ms`` of each version on the input copies, each verified first."""
    queries, key_cache, value_cache, tables, context_lens, scale = inputs
    out = torch.empty_like(queries[0])
    times = {}
    for version in versions:
        verify(kernels, queries[0], key_cache, value_cache, tables[0], context_lens, scale,
               version)

        def paged(i, version=version):
            kernels.paged_attention(queries[i], key_cache, value_cache, tables[i], context_lens,
                                    scale, context, out=out, version=version)

        times[f"v{version}_ms"] = time_ms(paged, copies)
    return times


def plan_name(kernels, batch: int, context: int, num_kv_heads: int = NUM_KV_HEADS) -> str:
    """What version 0 runs: V1, or V2 / V3 (grouped) with its partition size (V2/64)."""
    chosen, _, partition_size = kernels.paged_attention_plan(batch, NUM_HEADS, HEAD_SIZE, context,
                                                             num_kv_heads=num_kv_heads)
    return f"V{chosen}" + (f"/{partition_size}" if chosen != 1 else "")


def time_paged(kernels, batch: int, context: int, copies: int, sweep_sizes=(),
               fused_sizes=()) -> dict:
    """Our kernel, and gather + SDPA, on a shuffled pool of `copies` independent batches:
    ``p{size}_ms`` for each of ``sweep_sizes``, ``f{size}_ms`` for each of ``fused_sizes``
    (the fused reduce; size 0 is the automatic plan)."""
    inputs = paged_inputs(batch, context, copies)
    queries, key_cache, value_cache, tables, context_lens, scale = inputs
    times = time_versions(kernels, inputs, context, copies, (1, 2, 0))
    times["chosen"] = plan_name(kernels, batch, context)
    times["paged_ms"] = times["v0_ms"]
    for size in sweep_sizes:
        times[f"p{size}_ms"] = time_forced(kernels, inputs, context, copies, size, fused=False)
    for size in fused_sizes:
        times[f"f{size}_ms"] = time_forced(kernels, inputs, context, copies, size, fused=True)
    if 2 * kv_bytes(batch, context) <= BASELINE_LIMIT:
        from minipaged.kernels.reference import gather_kv

        def gather(i):
            k, v = gather_kv(key_cache, value_cache, tables[i])  # (B, kv_heads, L, D) copies
            q = queries[i].unsqueeze(2)  # (B, H, 1, D)
            F.scaled_dot_product_attention(q, k, v, scale=scale)  # L == context here

        times["gather_ms"] = time_ms(gather, copies)
    return times


def time_forced(kernels, inputs, context: int, copies: int, size: int, fused: bool) -> float:
    """V2 with ``size``-token partitions (0: version 0, the plan's choice), combined by the
    reduce kernel or, ``fused``, by the partitions' last CUDA block; verified first."""
    queries, key_cache, value_cache, tables, context_lens, scale = inputs
    out = torch.empty_like(queries[0])
    version = 2 if size else 0
    kernels.force_partition_size(size)
    kernels.set_v2_reduce(1 if fused else 0)
    try:
        verify(kernels, queries[0], key_cache, value_cache, tables[0], context_lens, scale,
               version)

        def forced(i):
            kernels.paged_attention(queries[i], key_cache, value_cache, tables[i], context_lens,
                                    scale, context, out=out, version=version)

        return time_ms(forced, copies)
    finally:
        kernels.set_v2_reduce(0)
        kernels.force_partition_size(0)


def verify(kernels, query, key_cache, value_cache, tables, context_lens, scale, version,
           num_checked: int = 4) -> None:
    """The kernel's output for the first sequences against the torch reference (fp32)."""
    from minipaged.kernels import reference

    n = min(num_checked, query.shape[0])
    out = kernels.paged_attention(query[:n], key_cache, value_cache, tables[:n],
                                  context_lens[:n], scale, version=version)
    ref = reference.paged_attention(query[:n], key_cache, value_cache, tables[:n],
                                    context_lens[:n], scale)
    err = ((out.double() - ref.double()).flatten(1).norm(dim=1)
           / ref.double().flatten(1).norm(dim=1)).max().item()
    # both outputs are rounded to the cache's dtype: bf16 keeps 8 bits of mantissa, fp16 11
    tolerance = 1e-2 if query.dtype == torch.bfloat16 else 2e-3
    if not err < tolerance:  # (NaN fails too)
        raise SystemExit(f"V{version} disagrees with the reference ({query.dtype}): relative "
                         f"error {err:.2e}")


def time_contiguous(batch: int, context: int, copies: int) -> dict:
    """SDPA over an unpaged cache (batch, kv_heads, context, head_size) of the same size."""
    if kv_bytes(batch, context) * copies > 24 * 2**30:
        return {}
    k = torch.empty(copies, batch, NUM_KV_HEADS, context, HEAD_SIZE, dtype=DTYPE,
                    device="cuda").normal_()
    v = torch.empty_like(k).normal_()
    queries = torch.randn(copies, batch, NUM_HEADS, 1, HEAD_SIZE, dtype=DTYPE, device="cuda")
    scale = HEAD_SIZE ** -0.5

    def contiguous(i):
        F.scaled_dot_product_attention(queries[i], k[i], v[i], scale=scale)

    return {"sdpa_ms": time_ms(contiguous, copies)}


def kv_bytes(batch: int, context: int) -> int:
    """Bytes of keys and values one decode step must read."""
    return batch * context * kv_bytes_per_token(1, NUM_KV_HEADS, HEAD_SIZE, DTYPE.itemsize)


def bench_one(kernels, batch: int, context: int, l2_bytes: int, sweep_sizes=(),
              fused_sizes=()) -> dict:
    copies, warning = rotation_copies(kv_bytes(batch, context), l2_bytes)
    if warning:
        print(f"batch {batch}, context {context}: {warning}", flush=True)
    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes(batch, context),
           "copies": copies}
    row.update(time_paged(kernels, batch, context, copies, sweep_sizes, fused_sizes))
    torch.cuda.empty_cache()  # each helper's tensors are gone once it returns
    row.update(time_contiguous(batch, context, copies))
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument("--eager", action="store_true",
                        help="time plain calls, not replays of a CUDA graph")
    parser.add_argument("--partitions", action="store_true",
                        help="also sweep V2's partition size for small batches")
    parser.add_argument("--gqa", action="store_true",
                        help="only the grouped-query table (32 query heads on 8 kv heads)")
    parser.add_argument("--grid", action="store_true",
                        help="only the grid: GQA and MHA, fp16 and bf16, each case warm (one "
                             "input copy) and cold (copies past 4 x L2)")
    args = parser.parse_args()
    global USE_GRAPHS
    USE_GRAPHS = not args.eager
    if not torch.cuda.is_available():
        print("benchmarks/kernel.py: CUDA is required (no GPU visible to torch); nothing to do.")
        return 0
    from minipaged.kernels import build

    kernels = build.CUDA_OP.load()
    if kernels is None:
        print("benchmarks/kernel.py: the minipaged CUDA kernels did not build (see the warning)")
        return 1

    if args.grid:
        grid_table(kernels)
        return 0
    if args.gqa:
        gqa_table(kernels, l2_cache_bytes()[0], [1, 64] if args.quick else GQA_BATCHES,
                  [1024, 4096] if args.quick else GQA_CONTEXTS)
        return 0
    batches = [1, 64, 256] if args.quick else BATCHES
    contexts = [128, 1024, 4096] if args.quick else CONTEXTS
    copy_bw = copy_bandwidth()
    l2_bytes, l2_source = l2_cache_bytes()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bw / 1e12:.2f} TB/s "
          f"(read + write); L2 {l2_bytes / 1e6:.0f} MB ({l2_source}): each case rotates through "
          f"enough input copies to touch more than {L2_FACTOR} x L2 per pass")
    print(f"decode attention, fp16, head size {HEAD_SIZE}, {NUM_HEADS} heads / {NUM_KV_HEADS} "
          f"kv heads, block size {BLOCK_SIZE}; times in microseconds (median, "
          f"{'CUDA graph replays' if USE_GRAPHS else 'eager calls'})")
    header = (f"{'batch':>5} {'context':>7} {'K/V MB':>8} {'copies':>6} {'v1':>9} {'v2':>9} "
              f"{'auto':>9} {'plan':>7} {'gather':>9} {'sdpa':>9} {'auto TB/s':>10} "
              f"{'of copy':>8}")
    print(header)
    print("-" * len(header))
    goal = []
    for batch in batches:
        for context in contexts:
            row = bench_one(kernels, batch, context, l2_bytes)
            bw = row["kv_bytes"] / (row["paged_ms"] * 1e-3)
            fraction = bw / copy_bw

            us = [f"{row[k] * 1e3:9.1f}" if k in row else f"{'-':>9}"
                  for k in ("v1_ms", "v2_ms", "v0_ms")]
            base = [f"{row[k] * 1e3:9.1f}" if k in row else f"{'-':>9}"
                    for k in ("gather_ms", "sdpa_ms")]
            print(f"{batch:5d} {context:7d} {row['kv_bytes'] / 1e6:8.1f} {row['copies']:6d} "
                  f"{' '.join(us)} "
                  f"{row['chosen']:>7} {' '.join(base)} {bw / 1e12:10.2f} "
                  f"{fraction:8.0%}", flush=True)
            if batch >= 64 and context >= 1024:
                goal.append(fraction)
    if goal:
        print(f"\nbatch >= 64 and context >= 1024: paged attention reaches {min(goal):.0%} to "
              f"{max(goal):.0%} of copy bandwidth (goal: at least 70%)")
    if args.partitions:
        partition_sweep(kernels, copy_bw, l2_bytes)
    gqa_table(kernels, l2_bytes, [1, 64] if args.quick else GQA_BATCHES,
              [1024, 4096] if args.quick else GQA_CONTEXTS)
    return 0


GQA_KV_HEADS = 8  # 32 query heads on 8 kv heads: LLaMA-3 8B's layer
GQA_BATCHES = [1, 8, 64, 256]
GQA_CONTEXTS = [512, 2048, 8192]


def gqa_table(kernels, l2_bytes: int, batches, contexts) -> None:
    """Grouped-query attention: the per-head kernels (V1, V2) against the grouped one (V3)."""
    group = NUM_HEADS // GQA_KV_HEADS
    print(f"\ngrouped-query attention: {NUM_HEADS} query heads on {GQA_KV_HEADS} kv heads "
          f"(group {group}), head size {HEAD_SIZE}, fp16; us, median. 'read' is the K/V bytes "
          f"a kernel loads: V1 and V2 load each kv head {group} times, V3 once")
    header = (f"{'batch':>5} {'context':>7} {'K/V MB':>8} {'v1':>9} {'v2':>9} {'v3':>9} "
              f"{'auto':>9} {'plan':>7} {'v3 speed-up':>12}")
    print(header)
    print("-" * len(header))
    for batch in batches:
        for context in contexts:
            nbytes = batch * context * kv_bytes_per_token(1, GQA_KV_HEADS, HEAD_SIZE,
                                                          DTYPE.itemsize)
            copies, warning = rotation_copies(nbytes, l2_bytes)
            if warning:
                print(f"batch {batch}, context {context}: {warning}", flush=True)
            inputs = paged_inputs(batch, context, copies, GQA_KV_HEADS)
            row = time_versions(kernels, inputs, context, copies, (1, 2, 3, 0))
            del inputs
            torch.cuda.empty_cache()
            per_head = min(row["v1_ms"], row["v2_ms"])
            cells = " ".join(f"{row[f'v{v}_ms'] * 1e3:9.1f}" for v in (1, 2, 3, 0))
            print(f"{batch:5d} {context:7d} {nbytes / 1e6:8.1f} {cells} "
                  f"{plan_name(kernels, batch, context, GQA_KV_HEADS):>7} "
                  f"{per_head / row['v3_ms']:11.2f}x", flush=True)


SWEEP_SIZES = (64, 128, 256, 512)
FUSED_SIZES = (*SWEEP_SIZES, 0)  # 0: the automatic plan ("fused auto")
FUSED_BATCHES = (1,)  # the fused reduce's columns only here: the sweep stays within its budget


def partition_sweep(kernels, copy_bw: float, l2_bytes: int) -> None:
    """Small batches: V2 with each partition size forced, next to V1 and the automatic plan;
    batch 1 also with the fused reduce (the partitions' last CUDA block combines them)."""
    print(f"\nsmall batches, V2 by partition size, then (batch 1) the same with the fused "
          f"reduce (us; % of copy for auto)")
    fused_names = [f"fused/{s}" if s else "fused auto" for s in FUSED_SIZES]
    header = (f"{'batch':>5} {'context':>7} {'v1':>9} "
              + " ".join(f"{'v2/' + str(s):>9}" for s in SWEEP_SIZES)
              + f" {'auto':>9} {'plan':>7} {'of copy':>8} "
              + " ".join(f"{name:>10}" for name in fused_names))
    print(header)
    print("-" * len(header))
    for batch in (1, 4, 16):
        for context in (256, 1024, 4096, 16384):
            fused = FUSED_SIZES if batch in FUSED_BATCHES else ()
            row = bench_one(kernels, batch, context, l2_bytes, SWEEP_SIZES, fused)
            fraction = row["kv_bytes"] / (row["v0_ms"] * 1e-3) / copy_bw
            cells = " ".join(f"{row[f'p{s}_ms'] * 1e3:9.1f}" for s in SWEEP_SIZES)
            fused_cells = " ".join(f"{row[f'f{s}_ms'] * 1e3:10.1f}" if f"f{s}_ms" in row
                                   else f"{'-':>10}" for s in FUSED_SIZES)
            print(f"{batch:5d} {context:7d} {row['v1_ms'] * 1e3:9.1f} {cells} "
                  f"{row['v0_ms'] * 1e3:9.1f} {row['chosen']:>7} {fraction:8.0%} {fused_cells}",
                  flush=True)


# -- the grid (--grid): every case warm and cold -------------------------------------------------
# (name, kv heads, versions timed): 32 query heads of 128 on 8 kv heads (the grouped kernel, V3,
# and the automatic plan), and on 32 (multi-head: the automatic plan)
GRID_SHAPES = (("GQA 32/8", 8, (3, 0)), ("MHA 32/32", 32, (0,)))
GRID_DTYPES = (torch.float16, torch.bfloat16)
GRID_BATCHES = (1, 8, 64)
GRID_CONTEXTS = (1024, 4096, 16384)
GRID_L2_FACTOR = 4  # cold: one pass over a case's copies touches more than 4 x L2
GRID_ROUNDS = 15  # replays timed per measurement (the median is kept) ...
GRID_BIG_ROUNDS = 5  # ... and for a call that reads at least GRID_BIG_BYTES
GRID_BIG_BYTES = 2**30
# the time budget's model (grid_time_estimate), set from gpu-check stage 3 on an H200 (16 s for
# about 150 measurements of the same helpers, start-up included: ~0.04 s each after ~10 s)
GRID_START_S = 10.0  # python, torch, loading the built kernels, the copy bandwidth
GRID_MEASURE_S = 0.1  # one measurement's host work: inputs, check, capture
GRID_CALL_FLOOR_S = 10e-6  # the shortest call (batch 1, 1,024 tokens) takes about this
GRID_BANDWIDTH = 2.5e12  # K/V bytes per second assumed for the estimate (an H100 reaches more)


def grid_cases() -> list[tuple]:
    """The grid's cases in print order: (shape name, kv heads, versions, dtype, batch, context)."""
    return [(name, kv_heads, versions, dtype, batch, context)
            for name, kv_heads, versions in GRID_SHAPES for dtype in GRID_DTYPES
            for batch in GRID_BATCHES for context in GRID_CONTEXTS]


def grid_kv_bytes(batch: int, context: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    """K/V bytes a kernel must read for one decode step: every kv head once (a grouped kernel
    serves its query heads from one read), a key and a value per token.

    Args:
        batch: sequences in the step.
        context: tokens of each sequence.
        num_kv_heads: kv heads of the layer (not query heads).
        dtype: the cache's element type.
    """
    return batch * context * kv_bytes_per_token(1, num_kv_heads, HEAD_SIZE, dtype.itemsize)


def grid_copies(bytes_per_copy: int, l2_bytes: int) -> tuple[int, int, str | None]:
    """(warm copies, cold copies, warning or None) for a case that reads ``bytes_per_copy``.

    Warm replays one copy (1); cold rotates through copies until one pass touches more than
    ``GRID_L2_FACTOR`` x L2 (``rotation_copies``). Cold 1 means one copy already passes that:
    warm and cold are then the same measurement, timed once.

    Args:
        bytes_per_copy: K/V bytes one call reads.
        l2_bytes: the GPU's L2 cache size.
    """
    cold, warning = rotation_copies(bytes_per_copy, l2_bytes, factor=GRID_L2_FACTOR)
    return 1, cold, warning


def grid_rounds(bytes_per_call: int) -> int:
    """Replays timed for a call reading ``bytes_per_call``: fewer for the largest calls (ms
    each, so that the grid stays within its budget; 5 replays of 10 calls still give a median)."""
    return GRID_BIG_ROUNDS if bytes_per_call >= GRID_BIG_BYTES else GRID_ROUNDS


def grid_time_estimate(l2_bytes: int, bandwidth: float = GRID_BANDWIDTH) -> float:
    """Seconds the grid should take on a GPU of ``l2_bytes`` of L2 that reads K/V at
    ``bandwidth`` bytes/s: start-up, host work per measurement, and every kernel call that
    time_ms makes (3 warm-ups, 1 on the capture stream, 1 replay checking the graph, then the
    timed replays, each of max(10, copies) calls) plus the check and filling the inputs.

    Args:
        l2_bytes: the GPU's L2 cache size.
        bandwidth: K/V bytes per second a kernel reads (calls never faster than 10 us).
    """
    total = GRID_START_S
    for _, kv_heads, versions, dtype, batch, context in grid_cases():
        nbytes = grid_kv_bytes(batch, context, kv_heads, dtype)
        _, cold, _ = grid_copies(nbytes, l2_bytes)
        call_s = max(nbytes / bandwidth, GRID_CALL_FLOOR_S)
        total += cold * nbytes / bandwidth  # filling the pool (normal_ writes it once)
        for _ in versions:
            total += call_s  # the reference check (a few sequences; counted as one call)
            for copies in ((1, cold) if cold > 1 else (1,)):
                calls = max(10, copies)
                total += GRID_MEASURE_S + (4 + (grid_rounds(nbytes) + 1) * calls) * call_s
    return total


def grid_table(kernels) -> None:
    """The grid: for each case the kernel's time and K/V bandwidth warm and cold."""
    import time

    began = time.perf_counter()
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    l2_bytes, l2_source = l2_cache_bytes()
    mode = "CUDA graph replays" if USE_GRAPHS else "eager calls"
    print(f"kernel grid on {torch.cuda.get_device_name()}: L2 {l2_bytes / 1e6:.1f} MB "
          f"({l2_source}); device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write, eager)")
    print(f"protocol: warm = one input copy, called again and again (K/V that fits in L2 may be "
          f"read from it); cold = each call reads the next of 'copies' copies, one pass over them "
          f"touching more than {GRID_L2_FACTOR} x L2; where one copy already passes that "
          f"(copies 1) warm and cold are one measurement, timed once")
    print(f"times: median over {GRID_ROUNDS} timed {mode} of max(10, copies) calls "
          f"({GRID_BIG_ROUNDS} for calls reading >= {GRID_BIG_BYTES / 2**30:.0f} GiB), after a "
          f"check of the outputs against the torch reference; TB/s = K/V bytes the kernel must "
          f"read (each kv head once) / time; 'copy' = that as a fraction of the copy")
    print(f"decode attention, head size {HEAD_SIZE}, {NUM_HEADS} query heads, block size "
          f"{BLOCK_SIZE}, blocks shuffled; estimated {grid_time_estimate(l2_bytes):.0f} s for "
          f"{len(grid_cases())} cases")
    header = (f"{'shape':<9} {'dtype':<5} {'batch':>5} {'context':>7} {'K/V MB':>8} "
              f"{'copies':>6} {'kernel':<12} {'warm us':>9} {'TB/s':>5} {'copy':>5} "
              f"{'cold us':>9} {'TB/s':>5} {'copy':>5}")
    print(header)
    print("-" * len(header))
    for name, kv_heads, versions, dtype, batch, context in grid_cases():
        nbytes = grid_kv_bytes(batch, context, kv_heads, dtype)
        _, cold, warning = grid_copies(nbytes, l2_bytes)
        if warning:
            print(f"{name}, batch {batch}, context {context}: {warning}", flush=True)
        inputs = paged_inputs(batch, context, cold, kv_heads, dtype)
        queries, key_cache, value_cache, tables, context_lens, scale = inputs
        out = torch.empty_like(queries[0])
        rounds = grid_rounds(nbytes)
        for version in versions:
            verify(kernels, queries[0], key_cache, value_cache, tables[0], context_lens, scale,
                   version)

            def paged(i, version=version):
                kernels.paged_attention(queries[i], key_cache, value_cache, tables[i],
                                        context_lens, scale, context, out=out, version=version)

            # warm: copy 0 only (its blocks lie among the cold copies', which it never reads)
            cells = [grid_cells(nbytes, time_ms(paged, 1, rounds=rounds), copy_bw)]
            if cold > 1:
                cells.append(grid_cells(nbytes, time_ms(paged, cold, rounds=rounds), copy_bw))
            else:
                cells.append(f"{'same as warm':>21}")  # one copy passes 4 x L2 by itself
            kernel = "v3" if version == 3 else "auto " + plan_name(kernels, batch, context,
                                                                    kv_heads)
            dtype_name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
            print(f"{name:<9} {dtype_name:<5} {batch:5d} {context:7d} {nbytes / 1e6:8.1f} "
                  f"{cold:6d} {kernel:<12} {cells[0]} {cells[1]}", flush=True)
        del inputs, queries, key_cache, value_cache, tables, out
        torch.cuda.empty_cache()
    print(f"\nthe grid took {time.perf_counter() - began:.0f} s (estimated "
          f"{grid_time_estimate(l2_bytes):.0f} s, start-up included)")


def grid_cells(nbytes: int, ms: float, copy_bw: float) -> str:
    """'time us, TB/s, fraction of the copy' of one measurement."""
    bw = nbytes / (ms * 1e-3)
    return f"{ms * 1e3:9.1f} {bw / 1e12:5.2f} {bw / copy_bw:5.0%}"


if __name__ == "__main__":
    sys.exit(main())
