"""The engine: one step of continuous batching, the async loop, request validation, output
processing, stats and snapshots, detokenizing."""
