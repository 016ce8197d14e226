from lab_bugs import bug

FORK = "        return [allocator.fork(block) for block in blocks]\n"
ENGINE = ("engine/greedy_samples", "engine/seeded_samples", "engine/under_preemption", "engine/with_prefix_caching")
BUGS = [
    bug("fork adds no owner", [(FORK, "        return list(blocks)\n")], "fork/one_more_owner", *ENGINE),
    bug("fork returns the parent's own table",
        [(FORK, "        for block in blocks:\n            allocator.fork(block)\n        return blocks\n")],
        "fork/separate_tables"),
    bug("a shared block is written in place",
        [("        if allocator.ref_count(old) == 1:\n", "        if True:\n")],
        "copy_on_write/shared_block_gets_a_copy", "copy_on_write/every_writer_gets_its_own", *ENGINE),
    bug("a private block is copied too",
        [("        if allocator.ref_count(old) == 1:\n            return None\n", "")],
        "copy_on_write/private_block_untouched", "copy_on_write/every_writer_gets_its_own"),
    bug("the shared block is freed for every owner",
        [("        allocator.free(old)\n", "        while allocator.ref_count(old):\n            allocator.free(old)\n")],
        "copy_on_write/shared_block_gets_a_copy", *ENGINE),
    bug("the writer keeps its reference to the old block",
        [("        allocator.free(old)\n", "")],
        "copy_on_write/shared_block_gets_a_copy", *ENGINE),
    bug("the copy is returned backwards",
        [("        return old, new\n", "        return new, old\n")],
        "copy_on_write/shared_block_gets_a_copy", "engine/seeded_samples"),
    bug("the new block comes from allocator.allocate()",
        [("        new = take_block()\n", "        new = allocator.allocate()\n")],
        "copy_on_write/uses_take_block", "engine/with_prefix_caching"),
]
