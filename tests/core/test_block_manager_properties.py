"""Property tests of the BlockSpaceManager (lessons 03 and 04).

A Hypothesis state machine drives the block manager the way the engine does: admit prompts,
grow every running sequence by one token per step (copy-on-write included), fork children
(parallel sampling) and re-fork dropped beams (beam search), finish sequences, preempt groups by
recompute, swap groups out to CPU blocks and back in, abort them.

Next to the block manager it keeps a *fake KV cache*: for every physical block, the token id
written into each slot. Block copies and swaps move those token ids exactly as the cache engine
moves K/V, and every new token is written through the sequence's block table. So besides the
bookkeeping invariants (ref counts, free lists) we check what really matters: reading a sequence
through its own block table gives back exactly its own tokens, whatever was shared, copied or
swapped before.

With prefix caching (lesson 11) the same machine runs with prompts that share prefixes: a prompt
takes cached blocks and writes only the rest, so reading its own tokens back proves that a hash
hit served the right KV, even with a hash function that collides on purpose.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from budgets import examples
from minipaged.block import Device
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.lab.no_sharing import NoSharingBlockManager
from minipaged.sampling_params import SamplingParams
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from prefix_cache_invariants import check_prefix_cache

pytestmark = [pytest.mark.lesson03, pytest.mark.lesson04]

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 24
NUM_CPU_BLOCKS = 16
VOCAB = 50
SYSTEM_PROMPT = [(3 * i + 1) % VOCAB for i in range(3 * BLOCK_SIZE)]  # prompts may start with it

# What happens to one running sequence after a step: it goes on, finishes, or forks a child.
ACTIONS = st.lists(st.tuples(st.sampled_from(["go", "go", "go", "finish", "fork"]),
                             st.integers(0, VOCAB - 1)), min_size=1, max_size=4)


class BlockManagerMachine(RuleBasedStateMachine):
    manager_class = BlockSpaceManager
    enable_caching = False
    hash_fn = None  # a colliding hash function, for the collision test

    def __init__(self) -> None:
        super().__init__()
        self.bm = self.manager_class(BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, watermark=0.05,
                                     enable_prefix_caching=self.enable_caching)
        if self.hash_fn is not None:
            self.bm.gpu_allocator.hash_fn = type(self).hash_fn
        # The scheduler's _append_slots is the code that turns appends into blocks_to_copy.
        self.scheduler = Scheduler(SchedulerConfig(), self.bm)
        self.groups: list[SequenceGroup] = []  # every group not yet aborted
        self.cache: dict[tuple[Device, int], list[int | None]] = {}  # fake K/V: token ids
        self.next_seq_id = 0
        self.next_request = 0

    # -- helpers ---------------------------------------------------------------------------------
    def _new_seq(self, prompt: list[int]) -> Sequence:
        seq = Sequence(self.next_seq_id, None, prompt, BLOCK_SIZE)
        self.next_seq_id += 1
        return seq

    def _slot(self, seq: Sequence, pos: int) -> tuple[tuple[Device, int], int]:
        block = self.bm.block_tables[seq.seq_id][pos // BLOCK_SIZE]
        return (block.device, block.block_number), pos % BLOCK_SIZE

    def _write(self, seq: Sequence, pos: int) -> None:
        """The model writes the K/V of token ``pos`` into its slot."""
        key, offset = self._slot(seq, pos)
        self.cache.setdefault(key, [None] * BLOCK_SIZE)[offset] = seq.get_token_ids()[pos]

    def _move(self, src: Device, dst: Device, mapping: dict[int, int]) -> None:
        """What the cache engine does with blocks_to_copy / swap_in / swap_out."""
        moved = {d: list(self.cache.get((src, s), [None] * BLOCK_SIZE))
                 for s, d in mapping.items()}
        for d, slots in moved.items():
            self.cache[(dst, d)] = slots

    def _apply_copies(self, blocks_to_copy: dict[int, list[int]]) -> None:
        for src, dsts in blocks_to_copy.items():
            for dst in dsts:
                self.cache[(Device.GPU, dst)] = list(self.cache[(Device.GPU, src)])

    def _pick(self, candidates: list, i: int):
        return candidates[i % len(candidates)]

    def _groups(self, status: SequenceStatus) -> list[SequenceGroup]:
        return [g for g in self.groups if g.num_seqs(status) > 0]

    def _sample_next_tokens(self, group: SequenceGroup, actions) -> None:
        """After a model run: every running sequence gets a next token, or finishes, or forks."""
        running = group.get_seqs(SequenceStatus.RUNNING)
        for k, seq in enumerate(running):
            action, token = actions[k % len(actions)]
            if action == "finish":
                seq.status = SequenceStatus.FINISHED_STOPPED
                self.bm.free(seq)
                continue
            if action == "fork" and len(group.seqs) < 6:
                child = self._new_seq(seq.prompt_token_ids)
                child.copy_state_from(seq)
                child.status = SequenceStatus.RUNNING
                self.bm.fork(seq, child)
                group.seqs.append(child)
                child.append_token_id((token + 1) % VOCAB, {(token + 1) % VOCAB: -1.0})
            seq.append_token_id(token, {token: -0.5})

    # -- rules -----------------------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 3 * BLOCK_SIZE + 1), num_seqs=st.integers(1, 3),
          first=st.integers(0, VOCAB - 1), num_system=st.integers(0, 3 * BLOCK_SIZE))
    def add_request(self, prompt_len, num_seqs, first, num_system):
        prompt = [(first + 7 * i) % VOCAB for i in range(prompt_len)]
        prompt[:num_system] = SYSTEM_PROMPT[:min(num_system, prompt_len)]
        params = SamplingParams(n=num_seqs, temperature=1.0)
        group = SequenceGroup(str(self.next_request), [self._new_seq(prompt)
                                                       for _ in range(num_seqs)],
                              params, arrival_time=float(self.next_request))
        self.next_request += 1
        self.groups.append(group)

    @precondition(lambda self: self._groups(SequenceStatus.WAITING))
    @rule(i=st.integers(0, 100), actions=ACTIONS)
    def admit(self, i, actions):
        """The prefill step: allocate, compute every token, sample the next ones."""
        group = self._pick(self._groups(SequenceStatus.WAITING), i)
        if not self.bm.can_allocate(group):
            assert (self.bm.get_num_free_gpu_blocks() - self.bm.num_blocks_to_allocate(group)
                    < self.bm.watermark_blocks)
            return
        free_before = self.bm.get_num_free_gpu_blocks()
        expected = self.bm.num_blocks_to_allocate(group)
        cached = self.bm.allocate(group)
        assert free_before - self.bm.get_num_free_gpu_blocks() == expected
        for seq in group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.RUNNING
            # Tokens taken from the prefix cache are not written: they must already be there.
            assert cached[seq.seq_id] < seq.get_len()
            if cached[seq.seq_id]:
                event("a prompt took cached blocks")
            for pos in range(cached[seq.seq_id], seq.get_len()):
                self._write(seq, pos)
            seq.num_computed_tokens = seq.get_len()
            self.bm.cache_blocks(seq, seq.get_len())
        self._sample_next_tokens(group, actions)

    @precondition(lambda self: self._groups(SequenceStatus.RUNNING))
    @rule(i=st.integers(0, 100), actions=ACTIONS)
    def decode_step(self, i, actions):
        """One decode step of a running group: slots (and copies), model writes, sampling."""
        group = self._pick(self._groups(SequenceStatus.RUNNING), i)
        if not self.bm.can_append_slot(group):
            return  # the scheduler would preempt; the preempt rules cover that
        self._run_step(group, actions)

    def _run_step(self, group: SequenceGroup, actions) -> None:
        free_before = self.bm.get_num_free_gpu_blocks()
        blocks_to_copy: dict[int, list[int]] = {}
        self.scheduler._append_slots(group, blocks_to_copy)
        for src, dsts in blocks_to_copy.items():
            assert src not in dsts
        num_copies = sum(len(d) for d in blocks_to_copy.values())
        assert free_before - self.bm.get_num_free_gpu_blocks() >= num_copies
        self._apply_copies(blocks_to_copy)
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            table = self.bm.block_tables[seq.seq_id]
            assert len(table) == len(seq.logical_token_blocks)
            # The block about to be written belongs to this sequence alone (copy-on-write).
            assert table[-1].ref_count == 1
            if self.manager_class is NoSharingBlockManager:
                assert all(b.ref_count == 1 for b in table)
            self._write(seq, seq.get_len() - 1)
            seq.num_computed_tokens = seq.get_len()
        self._sample_next_tokens(group, actions)

    @precondition(lambda self: any(g.num_seqs(SequenceStatus.RUNNING) >= 2 for g in self.groups))
    @rule(i=st.integers(0, 100), j=st.integers(0, 100), token=st.integers(0, VOCAB - 1))
    def beam_refork(self, i, j, token):
        """Beam search drops a beam and reuses its sequence as a copy of another beam."""
        group = self._pick([g for g in self.groups
                            if g.num_seqs(SequenceStatus.RUNNING) >= 2], i)
        running = group.get_seqs(SequenceStatus.RUNNING)
        seq = running[j % len(running)]
        parent = running[(j + 1) % len(running)]
        self.bm.free(seq)
        seq.copy_state_from(parent)
        self.bm.fork(parent, seq)
        # Both now hold the parent's pending last token; make the reused one diverge instead.
        seq.output_token_ids[-1] = token
        seq.logical_token_blocks[-1].token_ids[-1] = token

    @precondition(lambda self: self._groups(SequenceStatus.RUNNING))
    @rule(i=st.integers(0, 100))
    def swap_out(self, i):
        group = self._pick(self._groups(SequenceStatus.RUNNING), i)
        if group.num_seqs(SequenceStatus.RUNNING) != group.num_seqs() - sum(
                s.is_finished() for s in group.seqs):
            return  # a group is swapped whole
        distinct = {id(b) for s in group.get_seqs(SequenceStatus.RUNNING)
                    for b in self.bm.block_tables[s.seq_id]}
        free_gpu = self.bm.get_num_free_gpu_blocks()
        if not self.bm.can_swap_out(group):
            assert len(distinct) > self.bm.get_num_free_cpu_blocks()
            with pytest.raises(RuntimeError, match="swap space"):
                self.bm.swap_out(group)
            assert self.bm.get_num_free_gpu_blocks() == free_gpu  # nothing moved
            return
        holders: dict[int, int] = {}  # block -> references from this group
        for s in group.get_seqs(SequenceStatus.RUNNING):
            for b in self.bm.block_tables[s.seq_id]:
                holders[id(b)] = holders.get(id(b), 0) + 1
        only_ours = sum(b.ref_count == holders[id(b)] for b in self.bm.gpu_allocator.blocks
                        if id(b) in holders)  # cached blocks may be held by other requests
        mapping = self.bm.swap_out(group)
        assert len(mapping) == len(distinct)  # a shared block is moved once
        assert self.bm.get_num_free_gpu_blocks() == free_gpu + only_ours
        self._move(Device.GPU, Device.CPU, mapping)
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED

    @precondition(lambda self: self._groups(SequenceStatus.SWAPPED))
    @rule(i=st.integers(0, 100), actions=ACTIONS)
    def swap_in(self, i, actions):
        group = self._pick(self._groups(SequenceStatus.SWAPPED), i)
        if not self.bm.can_swap_in(group):
            return
        free_cpu = self.bm.get_num_free_cpu_blocks()
        distinct = len(self.bm._physical_blocks(group, SequenceStatus.SWAPPED))
        mapping = self.bm.swap_in(group)
        assert self.bm.get_num_free_cpu_blocks() == free_cpu + distinct
        # Blocks the prefix cache still holds on the GPU are taken back, not copied.
        assert len(mapping) <= distinct if self.enable_caching else len(mapping) == distinct
        self._move(Device.CPU, Device.GPU, mapping)
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING
        # As the scheduler does, the group runs at once: can_swap_in promised room for its
        # slots (and, without sharing, its copies), so this must not run out of blocks.
        self._run_step(group, actions)

    @precondition(lambda self: self._groups(SequenceStatus.RUNNING))
    @rule(i=st.integers(0, 100))
    def preempt_by_recompute(self, i):
        group = self._pick(self._groups(SequenceStatus.RUNNING), i)
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self.bm.free(seq)
            seq.reset_for_recompute()

    @precondition(lambda self: self.groups)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        group = self._pick(self.groups, i)
        for seq in group.get_seqs():
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.bm.free(seq)
        self.groups.remove(group)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def ref_counts_equal_table_references(self):
        holders: dict[int, int] = {}
        for table in self.bm.block_tables.values():
            for block in table:
                holders[id(block)] = holders.get(id(block), 0) + 1
        for allocator in (self.bm.gpu_allocator, self.bm.cpu_allocator):
            # (with prefix caching, the free list ends with the evictable cached blocks)
            free_numbers = allocator.free_block_numbers()
            assert len(free_numbers) == len(set(free_numbers)), "a block is free twice"
            free = set(free_numbers)
            for block in allocator.blocks:
                assert block.ref_count == holders.get(id(block), 0), block
                # No block is both free and referenced; every unreferenced block is free.
                assert (block.block_number in free) == (block.ref_count == 0), block
            used = sum(b.ref_count > 0 for b in allocator.blocks)
            assert allocator.get_num_free_blocks() + used == allocator.num_blocks

    @invariant()
    def tables_match_sequence_states(self):
        live = {}
        for group in self.groups:
            for seq in group.seqs:
                if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                    live[seq.seq_id] = seq
        assert set(self.bm.block_tables) == set(live)
        for seq_id, table in self.bm.block_tables.items():
            seq = live[seq_id]
            device = Device.GPU if seq.status is SequenceStatus.RUNNING else Device.CPU
            assert all(block.device is device for block in table)
            # Tokens already computed have a slot; at most the pending token is still without.
            assert len(table) >= math.ceil(seq.num_computed_tokens / BLOCK_SIZE)
            assert len(table) <= len(seq.logical_token_blocks)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, table in self.bm.block_tables.items():
            seq = self.bm.seqs[seq_id]
            tokens = seq.get_token_ids()
            for pos in range(seq.num_computed_tokens):
                key, offset = self._slot(seq, pos)
                assert self.cache[key][offset] == tokens[pos], (seq, pos)

    @invariant()
    def prefix_cache_is_consistent(self):
        if self.enable_caching:
            check_prefix_cache(self.bm)

    def teardown(self):
        for group in self.groups:
            for seq in group.seqs:
                self.bm.free(seq)
        assert not self.bm.block_tables
        assert self.bm.get_num_free_gpu_blocks() == NUM_GPU_BLOCKS
        assert self.bm.get_num_free_cpu_blocks() == NUM_CPU_BLOCKS
        for allocator in (self.bm.gpu_allocator, self.bm.cpu_allocator):
            assert all(block.ref_count == 0 for block in allocator.blocks)


class NoSharingMachine(BlockManagerMachine):
    """The memory benchmark's baseline: every sequence gets private copies of shared blocks."""

    manager_class = NoSharingBlockManager


class PrefixCachingMachine(BlockManagerMachine):
    """Prompts that share prefixes take cached blocks; freed blocks stay cached until evicted."""

    enable_caching = True


def _colliding_hash(parent_hash, token_ids) -> int:
    return (sum(token_ids) + (parent_hash or 0)) % 3  # three names for every block there is


class CollidingPrefixCachingMachine(PrefixCachingMachine):
    """The test hook: a hash that collides all the time must never serve another prefix."""

    hash_fn = _colliding_hash


SETTINGS = settings(max_examples=examples(40), stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerWithSharing = BlockManagerMachine.TestCase
TestBlockManagerWithSharing.settings = SETTINGS
TestBlockManagerWithoutSharing = NoSharingMachine.TestCase
TestBlockManagerWithoutSharing.settings = SETTINGS
TestBlockManagerWithPrefixCaching = PrefixCachingMachine.TestCase
TestBlockManagerWithPrefixCaching.settings = SETTINGS
TestBlockManagerWithCollidingHashes = CollidingPrefixCachingMachine.TestCase
TestBlockManagerWithCollidingHashes.settings = SETTINGS
