"""Recording the block manager's event log, with a snapshot and a one-line caption per event.

``BlockSpaceManager.add_listener`` calls us after every operation (allocate, append,
copy_on_write, fork, free, swap_in, swap_out, unshare, and the scheduler's preempt). We keep the
event, a snapshot of the tables right after it, and a caption such as

    step 5: seq 2 appends token 33; block 7 is shared, copy-on-write to block 12

The player widget (``visualizer.widgets.EventPlayer``) steps through the recording.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RecordedStep:
    index: int  # position in the recording (0 = the state when recording started)
    event: dict  # the block manager's event ({"op": "start"} for index 0)
    blocks: dict  # BlockSpaceManager.snapshot() right after the event
    scheduler: dict | None  # Scheduler.snapshot() right after the event, if a scheduler was given
    engine_step: int | None  # the engine step the event happened in, if an engine was given
    caption: str

    @property
    def highlight_blocks(self) -> list[int]:
        """GPU blocks the event touched."""
        e = self.event
        op = e["op"]
        if op in ("allocate", "fork", "free", "lookahead", "rollback"):
            return list(e["blocks"])
        if op == "append":
            return [e["block"]]
        if op == "copy_on_write":
            return [e["src"], e["dst"]]
        if op == "unshare":
            return [b for pair in e["pairs"] for b in pair]
        if op == "swap_out":
            return list(e["mapping"])  # keys are GPU blocks
        if op == "swap_in":
            return list(e["mapping"].values())  # values are GPU blocks
        return []

    @property
    def marks(self) -> dict[str, list[int]]:
        """The event's changes by the legend's kind (``visualizer/legend.py``): blocks a table
        took ("new"), copy-on-write targets ("copied"), blocks back in the free list ("freed"),
        blocks a swap-out gave up ("preempted")."""
        e = self.event
        op = e["op"]
        free = {b["block_number"] for b in self.blocks["gpu_blocks"] if b["ref_count"] == 0}
        if op in ("allocate", "fork", "lookahead"):
            return {"new": list(e["blocks"])}
        if op == "append":
            return {"new": [e["block"]] if e["new_block"] else []}
        if op == "copy_on_write":
            return {"copied": [e["dst"]]}
        if op == "unshare":
            return {"copied": [dst for _, dst in e["pairs"]]}
        if op in ("free", "rollback"):
            return {"freed": [b for b in e["blocks"] if b in free]}
        if op == "swap_out":
            return {"preempted": list(e["mapping"])}
        if op == "swap_in":
            return {"new": list(e["mapping"].values())}
        return {}

    @property
    def highlight_seq(self) -> int | None:
        e = self.event
        return e.get("seq_id", e.get("child"))


class EventRecorder:
    """Keeps (event, snapshot) pairs from a block manager; ``recorder.steps`` is the log.

    Args:
        block_manager: the ``BlockSpaceManager`` to listen to.
        scheduler: optionally its ``Scheduler``, to snapshot the queues too.
        engine: optionally the ``LLMEngine``, to note which engine step each event belongs to.
    """

    def __init__(self, block_manager, scheduler=None, engine=None) -> None:
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.engine = engine
        self.steps: list[RecordedStep] = []
        self._append({"op": "start"})
        block_manager.add_listener(self._on_event)

    @classmethod
    def for_engine(cls, engine) -> EventRecorder:
        return cls(engine.block_manager, engine.scheduler, engine)

    def _on_event(self, event: dict) -> None:
        self._append(dict(event))

    def _append(self, event: dict) -> None:
        blocks = self.block_manager.snapshot()
        sched = self.scheduler.snapshot() if self.scheduler is not None else None
        engine_step = self.engine.stats.num_steps + 1 if self.engine is not None else None
        index = len(self.steps)
        caption = f"step {index}: {describe(event, blocks)}"
        self.steps.append(RecordedStep(index, event, blocks, sched, engine_step, caption))

    def detach(self) -> None:
        """Stop recording."""
        try:
            self.block_manager.remove_listener(self._on_event)
        except ValueError:
            pass  # already detached

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> RecordedStep:
        return self.steps[i]

    def __iter__(self):
        return iter(self.steps)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _last_token(snapshot: dict, seq_id: int):
    for s in snapshot["sequences"]:
        if s["seq_id"] == seq_id and s["logical_blocks"]:
            block = s["logical_blocks"][-1]
            return block["token_ids"][-1] if block["token_ids"] else None
    return None


def describe(event: dict, snapshot: dict) -> str:
    """One line saying what ``event`` did; ``snapshot`` is the state right after it."""
    op = event["op"]
    bs = snapshot["block_size"]
    if op == "start":
        return (f"{len(snapshot['free_gpu_blocks'])} of {len(snapshot['gpu_blocks'])} GPU "
                f"blocks free, {len(snapshot['sequences'])} sequences")
    if op == "allocate":
        seqs, blocks = event["seq_ids"], event["blocks"]
        who = f"seq {seqs[0]}" if len(seqs) == 1 else f"seqs {', '.join(map(str, seqs))}"
        text = f"request {event['request_id']} admitted: {who} get{'s' if len(seqs) == 1 else ''}"
        text += f" {_plural(len(blocks), 'block')} {blocks}"
        if len(seqs) > 1:
            text += f", shared by all {len(seqs)} (ref count {len(seqs)})"
        return text
    if op == "append":
        token = _last_token(snapshot, event["seq_id"])
        text = f"seq {event['seq_id']} appends token {token}"
        if event["new_block"]:
            return text + f"; its last block was full, new block {event['block']}"
        filled = next((s["logical_blocks"][-1]["num_filled"] for s in snapshot["sequences"]
                       if s["seq_id"] == event["seq_id"]), None)
        return text + f" into block {event['block']} (slot {filled} of {bs})"
    if op == "copy_on_write":
        token = _last_token(snapshot, event["seq_id"])
        return (f"seq {event['seq_id']} appends token {token}; block {event['src']} is shared, "
                f"copy-on-write to block {event['dst']}")
    if op == "unshare":
        pairs = ", ".join(f"{s}→{d}" for s, d in event["pairs"])
        return (f"seq {event['seq_id']} gets private copies of its shared blocks ({pairs}): "
                f"sharing is turned off")
    if op == "fork":
        return (f"seq {event['parent']} forks seq {event['child']}: "
                f"{_plural(len(event['blocks']), 'block')} {event['blocks']} shared, ref +1")
    if op == "free":
        free = set(snapshot["free_gpu_blocks"])
        back = [b for b in event["blocks"] if b in free]
        return (f"seq {event['seq_id']} is freed: {_plural(len(event['blocks']), 'block')} drop "
                f"a reference, {_plural(len(back), 'block')} back to the free list")
    if op in ("swap_out", "swap_in"):
        arrow = "GPU→CPU" if op == "swap_out" else "CPU→GPU"
        pairs = ", ".join(f"{s}→{d}" for s, d in event["mapping"].items())
        verb = "swapped out" if op == "swap_out" else "swapped in"
        return f"request {event['request_id']} {verb}, blocks {arrow}: {pairs}"
    if op == "preempt":
        return f"request {event['request_id']} preempted by {event['mode']}"
    if op == "lookahead":  # speculative decoding (lesson 12) or multi-step decode (lesson 15)
        return (f"seq {event['seq_id']} reserves {_plural(event['num_slots'], 'lookahead slot')}"
                f" for the tokens after its newest (guesses, or a multi-step run's)"
                + (f", new blocks {event['blocks']}" if event["blocks"] else ""))
    if op == "rollback":
        return (f"seq {event['seq_id']} keeps {event['num_tokens']} tokens"
                + (f"; blocks {event['blocks']} hold none of them (rejected guesses, or steps "
                   f"a run did not take): freed" if event["blocks"] else ""))
    return f"{op} {event}"
