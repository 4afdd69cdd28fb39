"""Lesson 20 as a learner answers it: the last position of a block by a helper of their own,
a while loop over every entry but the last, the dropped entries told by their sign."""

# %%
def last_position(index, size):
    """The last token position that block ``index`` of ``size`` tokens holds."""
    return (index + 1) * size - 1


# %%
def blocks_out_of_window(num_tokens, window, block_size, block_table):
    window_start = num_tokens - window  # the newest token reads from here on
    give_back = []
    i = 0
    while i < len(block_table) - 1:
        if block_table[i] >= 0 and last_position(i, block_size) < window_start:
            give_back.append(i)
        i += 1
    return give_back
