"""Lesson 03's hints for the block manager, by cause: the method whose call first went wrong,
and what in it (a ref count, a block opened at the wrong token, the free order, a table that
changed with another's, a state that only the three reading methods give).
"""
from __future__ import annotations

from minipaged.exercises.lockstep import _Call

_MANAGER_HINTS = {
    "can_allocate": "count the blocks the prompt needs (a block the sequences share counts "
                    "once) and keep watermark_blocks free: the scheduler admits exactly when "
                    "can_allocate says yes",
    "allocate": "every waiting sequence of the group gets a table; the blocks they share are "
                "held once per sequence (ref counts), the others are private; prompt_layout "
                "says how many tokens they share",
    "append_slot": "before writing the newest token into the last block: who else holds that "
                   "block? writing into a shared block would change the other sequences' "
                   "cache, so the writer needs a block of its own first",
    "fork": "fork copies the block TABLE, not the blocks: the child's list is its own, and "
            "every block in it is held by one table more",
    "free": "each block of the table loses one reference; only the ones nobody else holds go "
            "back to the free list; and the sequence holds nothing afterwards",
    "get_blocks": "get_blocks gives what a sequence holds now: a freed sequence, or one never "
                  "admitted, holds nothing",
    "set_blocks": "swapping moves a sequence to the other pool by set_blocks: what does the "
                  "sequence hold after it, and what do get_blocks and free see then?",
    "held_sequences": "held_sequences lists every sequence that holds blocks now, each once, "
                      "with the request it belongs to (a forked child belongs to its parent's)",
}
# sharper hints for a method that left a block's ref count wrong (the invariant broke there)
_REF_COUNT_HINTS = {
    "allocate": "allocate left a shared block's ref count short of the tables holding it: a "
                "block the group's sequences share is held once per sequence, so its ref "
                "count counts every one of them (prompt_layout says which blocks they share)",
    "append_slot": "append_slot left a ref count wrong: a copy-on-write gives the writer a "
                   "block of its own AND lets go of its reference to the shared one",
    "fork": "fork gave the child the parent's own list: the child's table must be a list of "
            "its own (a copy of the numbers), or the parent's next block or copy lands in the "
            "child's table too; and every block in it is held by one table more",
    "free": "free left a ref count wrong: each block of the table loses one reference (the "
            "others holding it keep theirs); only a block nobody holds is free again",
}
# which of the learner's methods made an event
_EVENT_METHOD = {"allocate": "allocate", "append": "append_slot",
                 "copy_on_write": "append_slot", "fork": "fork", "free": "free",
                 "swap_in": "set_blocks", "swap_out": "set_blocks"}
# which of the learner's methods a difference in the compared state points at, when no call does
_STATE_METHOD = {"held by no sequence": "get_blocks", "their requests": "held_sequences",
                 "their lengths": "held_sequences"}
def _manager_hint(wrong: tuple[_Call, str, _Call | None] | None, fallback: str) -> str:
    """The hint of the method whose call first went wrong (``fallback``: the method the
    step's events point at, when no single call differs)."""
    if wrong is None:
        return _MANAGER_HINTS[fallback]
    call, what, expected = wrong
    if what == "broken" and _changed_another_table(call, expected):
        return _REF_COUNT_HINTS["fork"]  # one list for two sequences: given at a fork
    if what == "broken" and call.method in _REF_COUNT_HINTS:
        return _REF_COUNT_HINTS[call.method]
    if call.method == "append_slot" and expected is not None and _new_block_differs(
            call, expected):
        return _BOUNDARY_HINT
    if what == "state" and expected is not None:
        keys = {k for k in expected.state if call.state.get(k) != expected.state[k]}
        if keys and keys <= set(_STATE_METHOD) and len({_STATE_METHOD[k] for k in keys}) == 1:
            return _MANAGER_HINTS[_STATE_METHOD[keys.pop()]]
    if call.method == "free" and what == "state" and _only_order_differs(call, expected):
        return ("free lets go of the blocks last block first: the first block of the table "
                "is freed last, so it is the next one out of the free list")
    return _MANAGER_HINTS[call.method]


_BOUNDARY_HINT = ("append_slot opens a new block only when the newest token lies past the "
                  "table's blocks (the sequence has more logical blocks than its table): a "
                  "block of block_size slots takes block_size tokens, full only once its last "
                  "slot is written; otherwise the token goes into the last block")


def _changed_another_table(call: _Call, expected: _Call | None) -> bool:
    """Did ``call`` (an append or a free of one sequence; every call before it matched the
    package's) change another sequence's table too? One list serving two sequences does that."""
    if expected is None or call.method not in ("append_slot", "free"):
        return False
    got, want = call.state["block tables"], expected.state["block tables"]
    return any(got.get(i) != want.get(i) for i in set(got) | set(want) if i != call.seq_id)


def _new_block_differs(call: _Call, expected: _Call) -> bool:
    """Did ``call`` open a new block where the package's wrote into the last one, or the
    other way round?"""
    new = lambda c: [e.get("new_block") for e in c.events if e["op"] == "append"]
    return bool(new(call) and new(expected)) and new(call) != new(expected)


def _only_order_differs(call: _Call, expected: _Call | None) -> bool:
    """Does ``call`` leave the same free blocks as ``expected``, only in another order?"""
    if expected is None:
        return False
    got, want = call.state, expected.state
    return (sorted(got["free GPU blocks"]) == sorted(want["free GPU blocks"])
            and {k: v for k, v in got.items() if k != "free GPU blocks"}
            == {k: v for k, v in want.items() if k != "free GPU blocks"})
