"""The models: GPT-2 and LLaMA over a flat batch of tokens with a paged attention layer (lesson 07)."""
