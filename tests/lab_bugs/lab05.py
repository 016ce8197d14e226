from lab_bugs import bug

FORK = "        return [allocator.fork(block) for block in blocks]\n"
CHECK_PRIVATE = "        if allocator.ref_count(old) == 1:\n            return None\n"
ENGINE = ("engine/greedy_samples", "engine/seeded_samples", "engine/under_preemption", "engine/with_prefix_caching")
BUGS = [
    bug("fork adds no owner", [(FORK, "        return list(blocks)\n")], "fork/one_more_owner", *ENGINE),
    bug("fork returns the parent's own table",
        [(FORK, "        for block in blocks:\n            allocator.fork(block)\n        return blocks\n")],
        "fork/separate_tables"),
    bug("a shared block is written in place",
        [("        if allocator.ref_count(old) == 1:\n", "        if True:\n")],
        "copy_on_write/shared_block_gets_a_copy", "copy_on_write/every_writer_gets_its_own", *ENGINE),
    bug("a private block is copied too", [(CHECK_PRIVATE, "")],
        "copy_on_write/private_block_untouched", "copy_on_write/every_writer_gets_its_own"),
    bug("the shared block is freed for every owner",
        [("        allocator.free(old)\n", "        while allocator.ref_count(old):\n            allocator.free(old)\n")],
        "copy_on_write/shared_block_gets_a_copy", *ENGINE),
    bug("the writer keeps its reference to the old block",
        [("        allocator.free(old)\n", "")],
        "copy_on_write/shared_block_gets_a_copy", "copy_on_write/every_writer_gets_its_own", *ENGINE),
    bug("the copy is returned backwards",
        [("        return old, new\n", "        return new, old\n")],
        "copy_on_write/shared_block_gets_a_copy", "engine/seeded_samples"),
    bug("the new block comes from allocator.allocate()",
        [("        new = take_block()\n", "        new = allocator.allocate()\n")],
        "copy_on_write/uses_take_block", "engine/with_prefix_caching"),
    # off by one: a block two tables share (one sample and its parent) is taken for private
    bug("a block with two owners counts as private",
        [("        if allocator.ref_count(old) == 1:\n", "        if allocator.ref_count(old) <= 2:\n")],
        "copy_on_write/shared_block_gets_a_copy", "copy_on_write/every_writer_gets_its_own", "engine/seeded_samples"),
    # the engine mostly writes the last block, but the index says which one
    bug("the copy always goes into the last entry",
        [("        blocks[index] = new\n", "        blocks[-1] = new\n")],
        "copy_on_write/shared_block_gets_a_copy"),
    bug("a block is taken before checking that it is shared",
        [("        old = blocks[index]\n" + CHECK_PRIVATE + "        new = take_block()\n",
          "        old = blocks[index]\n        new = take_block()\n" + CHECK_PRIVATE)],
        "copy_on_write/private_block_untouched", "copy_on_write/every_writer_gets_its_own"),
]
