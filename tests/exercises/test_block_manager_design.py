"""Lesson 03 leaves the block manager's data structure to the learner: the package reads the
tables only through ``get_blocks``, ``set_blocks`` and ``held_sequences``, the check compares
behaviour through them, and the cost check catches a poor choice. The slow variants below are
correct (the check passes them) but pay for their structure as the sequences or a table grow:
the cost check warns, naming the operation. The others keep the tables in structures of their
own, with other names than the package's, and pass both."""
import pytest

from minipaged.exercises import workbench
from minipaged.exercises.answers.lesson03 import MyBlockSpaceManager
from minipaged.exercises.cost import measure_cost
from cost_verdicts import assert_correct_but_warned


@pytest.fixture(autouse=True)
def _learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))


class TablesInAListOfPairs(MyBlockSpaceManager):
    """The tables as a list of ``[seq_id, blocks]`` pairs: every lookup walks the list."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tables = _ScannedTables()


class _ScannedTables:
    """Just enough of a dict, over a list of pairs, found by walking it."""

    def __init__(self):
        self.pairs = []

    def _find(self, seq_id):
        for pair in self.pairs:
            if pair[0] == seq_id:
                return pair
        return None

    def __contains__(self, seq_id):
        return self._find(seq_id) is not None

    def __getitem__(self, seq_id):
        pair = self._find(seq_id)
        if pair is None:
            raise KeyError(seq_id)
        return pair[1]

    def get(self, seq_id, default=None):
        pair = self._find(seq_id)
        return default if pair is None else pair[1]

    def __setitem__(self, seq_id, blocks):
        pair = self._find(seq_id)
        if pair is None:
            self.pairs.append([seq_id, blocks])
        else:
            pair[1] = blocks

    def pop(self, seq_id):
        pair = self._find(seq_id)
        self.pairs.remove(pair)
        return pair[1]


class FreeTakesBlocksOffOneByOne(MyBlockSpaceManager):
    """Frees the last block, then removes it from the table with ``list.remove``, which looks
    for it from the front: each block costs the length of the table."""

    def free(self, seq):
        if seq.seq_id not in self.tables:
            return
        table = self.tables[seq.seq_id]
        freed = list(table)
        while table:
            block = table[-1]
            self._allocator_of(block).free(block)
            table.remove(block)
        del self.tables[seq.seq_id]
        del self.holders[seq.seq_id]
        self._emit("free", seq_id=seq.seq_id, blocks=[b.block_number for b in freed])


class BlocksByLogicalIndex(MyBlockSpaceManager):
    """Correct and quick: one dict entry per (sequence, logical block index), with the number of
    blocks each sequence holds beside it (tables are never lists here)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at = {}        # (seq_id, index) -> block
        self.length = {}    # seq_id -> how many blocks it holds
        self.owner = {}     # seq_id -> (seq, request id)

    def _put(self, seq_id, blocks):
        for i in range(len(blocks), self.length.get(seq_id, 0)):
            del self.at[seq_id, i]
        for i, block in enumerate(blocks):
            self.at[seq_id, i] = block
        self.length[seq_id] = len(blocks)

    def allocate(self, seq_group):
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        num_shared = (len(seqs[0].logical_token_blocks) if identical
                      else shared_len // self.block_size)
        shared = []
        for _ in range(num_shared):
            block = self.gpu_allocator.allocate()
            for _ in seqs[1:]:
                self.gpu_allocator.acquire(block)
            shared.append(block)
        for seq in seqs:
            own = [self.gpu_allocator.allocate()
                   for _ in range(len(seq.logical_token_blocks) - num_shared)]
            self._put(seq.seq_id, shared + own)
            self.owner[seq.seq_id] = (seq, seq_group.request_id)
        self._emit("allocate", request_id=seq_group.request_id,
                   seq_ids=[s.seq_id for s in seqs],
                   blocks=self.get_block_table(seqs[0]), cached=[])
        return {seq.seq_id: 0 for seq in seqs}

    def append_slot(self, seq):
        n = self.length[seq.seq_id]
        if n < len(seq.logical_token_blocks):
            block = self.gpu_allocator.allocate()
            self.at[seq.seq_id, n] = block
            self.length[seq.seq_id] = n + 1
            self._emit("append", seq_id=seq.seq_id, block=block.block_number, new_block=True)
            return None
        last = self.at[seq.seq_id, n - 1]
        if last.ref_count == 1:
            self._emit("append", seq_id=seq.seq_id, block=last.block_number, new_block=False)
            return None
        copy = self.gpu_allocator.allocate()
        self.at[seq.seq_id, n - 1] = copy
        self.gpu_allocator.free(last)
        self._emit("copy_on_write", seq_id=seq.seq_id, src=last.block_number,
                   dst=copy.block_number)
        return last.block_number, copy.block_number

    def fork(self, parent, child):
        blocks = self.get_blocks(parent.seq_id)
        for block in blocks:
            self._allocator_of(block).acquire(block)
        self._put(child.seq_id, blocks)
        self.owner[child.seq_id] = (child, self.owner[parent.seq_id][1])
        self._emit("fork", parent=parent.seq_id, child=child.seq_id,
                   blocks=[b.block_number for b in blocks])

    def free(self, seq):
        if seq.seq_id not in self.length:
            return
        blocks = self.get_blocks(seq.seq_id)
        for block in reversed(blocks):
            self._allocator_of(block).free(block)
        self._put(seq.seq_id, [])
        del self.length[seq.seq_id], self.owner[seq.seq_id]
        self._emit("free", seq_id=seq.seq_id, blocks=[b.block_number for b in blocks])

    def get_blocks(self, seq_id):
        return [self.at[seq_id, i] for i in range(self.length.get(seq_id, 0))]

    def set_blocks(self, seq_id, blocks):
        self._put(seq_id, list(blocks))

    def held_sequences(self):
        return list(self.owner.values())


@pytest.mark.parametrize("variant, operation", [
    (TablesInAListOfPairs, "get_block_table (get_blocks)"),
    (FreeTakesBlocksOffOneByOne, "fork + free of a long table"),
])
def test_a_correct_manager_in_a_poor_structure_passes_the_check_and_gets_the_cost_warning(
        variant, operation):
    assert_correct_but_warned("BlockSpaceManager", variant, operation, "blocks")


@pytest.mark.parametrize("variant", [MyBlockSpaceManager, BlocksByLogicalIndex])
def test_a_structure_of_its_own_passes_the_check_and_the_cost_check(variant):
    result = workbench.check_component("BlockSpaceManager", variant, save=False)
    assert result.passed, str(result)
    verdict = measure_cost("BlockSpaceManager", variant)
    assert not verdict.slow, verdict.message()


def test_the_stub_dictates_no_structure():
    """The stub states behaviour: it names no attribute of the package's tables, and no
    ``self._emit(...)`` call in a fixed place."""
    from minipaged.exercises import lesson03

    stub = lesson03.MyBlockSpaceManager
    doc = stub.__doc__ + "".join(getattr(stub, name).__doc__ or "" for name in vars(stub)
                                 if callable(getattr(stub, name)))
    for attribute in ("block_tables", "seq_request", "self.seqs", "_register"):
        assert attribute not in doc, attribute
    assert "Then:" not in doc and "self._emit(\"" not in doc
    for method in ("get_blocks", "set_blocks", "held_sequences"):
        assert method in vars(stub), method
