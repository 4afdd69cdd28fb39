"""The engine: one step of continuous batching, the async loop, validation, detokenizing."""
