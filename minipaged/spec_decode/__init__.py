"""Speculative decoding (lesson 12): proposers guess tokens, the target verifies them in one
pass."""
