from lab_bugs import bug

BUGS = [
    bug("swap_out moves the head of the table, not the tail", [
        ("        tail = blocks if count is None else blocks[len(blocks) - count:]\n",
         "        tail = blocks if count is None else blocks[:count]\n")],
        "swap/swaps_out_the_tail", "engine/swaps_partial_tails_of_shared_sequences"),
    bug("new host blocks go after the ones already on the host", [
        ("        seq.host_blocks = hosts + seq.host_blocks", "        seq.host_blocks = seq.host_blocks + hosts")],
        "swap/swaps_out_the_tail"),
    bug("swap_out plans its copies without holding the host blocks they write", [
        ("            self.copy_out(block, host)  # this step's copy writes it; copy_out holds it until then\n",
         "            self.moves.swap_out.append((block, host))\n")],
        "swap/holds_the_host_blocks_it_writes"),
    bug("swap_in plans its copies back without holding the host blocks they read", [
        ("            self.copy_in(host, block)  # the copy back reads it in the step's last phase, held until then\n",
         "            self.moves.swap_in.append((host, block))\n")],
        "swap/holds_the_host_blocks_it_reads"),
    bug("swap_in pops the host blocks off the end", [
        ("        for host in seq.host_blocks:\n            block = self.take()\n",
         "        while seq.host_blocks:\n            host = seq.host_blocks.pop()\n            block = self.take()\n")],
        "swap/swaps_in_in_table_order", "engine/swaps_whole_sequences"),
    bug("swap_in leaves the freed host blocks listed", [
        ("            self.release_host(host)\n        seq.host_blocks = []\n        ### END SOLUTION\n\n    def drop",
         "            self.release_host(host)\n        ### END SOLUTION\n\n    def drop")],
        "swap/swaps_in_in_table_order", "engine/swaps_whole_sequences"),
    bug("host_blocks_needed ignores count", [
        ("        return sum(len(seq.block_table) if count is None else count for seq in seqs)\n",
         "        return sum(len(seq.block_table) for seq in seqs)\n")],
        "swap/counts_the_host_blocks_a_swap_needs"),
    bug("host_blocks_needed counts the blocks already on the host", [
        ("        return sum(len(seq.block_table) if count is None else count for seq in seqs)\n",
         "        return sum(len(seq.host_blocks) for seq in seqs)\n")],
        "swap/counts_the_host_blocks_a_swap_needs", "engine/falls_back_when_the_host_is_full"),
    bug("drop returns the tokens kept, not those lost", [
        ("        return before - seq.num_computed_tokens\n", "        return seq.num_computed_tokens\n")],
        "drop/returns_the_computed_tokens_lost", "engine/recomputes"),
    bug("drop counts whole blocks as lost tokens", [
        ("        return before - seq.num_computed_tokens\n",
         "        return (len(seq.block_table) if count is None else count) * self.block_size\n")],
        "drop/returns_the_computed_tokens_lost", "engine/recomputes"),
    bug("drop releases the device blocks before letting go of the host copies", [
        ("        for host in seq.host_blocks:  # they hold positions after the device blocks, so they go too\n"
         "            self.release_host(host)\n        seq.host_blocks = []\n"
         "        self.release(seq, len(seq.block_table) if count is None else count)\n",
         "        self.release(seq, len(seq.block_table) if count is None else count)\n"
         "        for host in seq.host_blocks:\n            self.release_host(host)\n        seq.host_blocks = []\n")],
        "drop/lets_go_of_host_copies"),
    bug("drop(seq) with count None releases nothing", [
        ("        self.release(seq, len(seq.block_table) if count is None else count)\n",
         "        self.release(seq, count or 0)\n")],
        "drop/returns_the_computed_tokens_lost", "drop/keeps_shared_blocks", "engine/recomputes"),
    bug("drop(seq) with count None keeps the first block (off by one)", [
        ("        self.release(seq, len(seq.block_table) if count is None else count)\n",
         "        self.release(seq, len(seq.block_table) - 1 if count is None else count)\n")],
        "drop/returns_the_computed_tokens_lost", "drop/keeps_shared_blocks", "engine/recomputes"),
    bug("host_blocks_needed counts only the full blocks (computed tokens // block_size)", [
        ("        return sum(len(seq.block_table) if count is None else count for seq in seqs)\n",
         "        return sum(seq.num_computed_tokens // self.block_size if count is None else count for seq in seqs)\n")],
        "swap/counts_the_host_blocks_a_swap_needs"),
    bug("host_blocks_needed also counts the blocks already on the host", [
        ("        return sum(len(seq.block_table) if count is None else count for seq in seqs)\n",
         "        return sum(len(seq.block_table) + len(seq.host_blocks) if count is None else count for seq in seqs)\n")],
        "swap/counts_the_host_blocks_a_swap_needs"),
    bug("drop frees the host copies but leaves them listed in seq.host_blocks", [
        ("            self.release_host(host)\n        seq.host_blocks = []\n        self.release(",
         "            self.release_host(host)\n        self.release(")],
        "drop/lets_go_of_host_copies"),
    bug("swap_in puts the blocks it brings back before the ones kept on the device", [
        ("            seq.block_table.append(block)\n            self.release_host(host)",
         "            seq.block_table.blocks.insert(0, block)\n            self.release_host(host)")],
        "swap/swaps_in_in_table_order", "engine/swaps_partial_tails_of_shared_sequences"),
]
