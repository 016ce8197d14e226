from lab_bugs import bug

BUGS = [
    bug("running sequences compute one token a step", [
        ("            num_new = min(seq.num_uncomputed_tokens, budget)\n            if num_new == 0:",
         "            num_new = min(1, budget)\n            if num_new == 0:")],
        "schedule_running/continues_chunked_prefills"),
    bug("the running loop never spends the budget", [
        ("                self.start(seq, num_new, end, out)\n                budget -= num_new\n",
         "                self.start(seq, num_new, end, out)\n")],
        "schedule_running/continues_chunked_prefills", "engine/serves_chunked_prefills_and_recomputation"),
    bug("a sequence preempted earlier in the loop is still scheduled", [
        ("            if seq.status is not SequenceStatus.RUNNING:\n                continue  # preempted earlier in this loop\n",
         "")],
        "schedule_running/skips_preempted_sequences", "engine/serves_chunked_prefills_and_recomputation"),
    bug("make_room's answer is ignored", [
        ("            if self.make_room(seq, end, out):\n                self.start(seq, num_new, end, out)\n"
         "                budget -= num_new\n",
         "            self.make_room(seq, end, out)\n            self.start(seq, num_new, end, out)\n"
         "            budget -= num_new\n")],
        "schedule_running/respects_make_room", "engine/serves_chunked_prefills_and_recomputation"),
    bug("the waiting queue goes before the swapped one", [
        ("        line = sorted(self.swapped + self.waiting, key=lambda s: (s.arrival_time, s.seq_id))\n",
         "        line = self.waiting + self.swapped\n")],
        "schedule_waiting/serves_both_queues_in_arrival_order"),
    bug("a sequence that does not fit is skipped, so newer ones overtake it", [
        ("                if not self.bm.can_swap_in(seq, end, use_watermark):\n                    break\n",
         "                if not self.bm.can_swap_in(seq, end, use_watermark):\n                    continue\n"),
        ("                if not self.bm.can_admit(seq, hits, end, use_watermark):\n                    break\n",
         "                if not self.bm.can_admit(seq, hits, end, use_watermark):\n                    continue\n")],
        "schedule_waiting/stops_at_the_first_that_does_not_fit"),
    bug("max_num_seqs counts sequences, not the samples they will fork", [
        ("self.running_slots + seq.num_slots > self.config.max_num_seqs",
         "len(self.running) + 1 > self.config.max_num_seqs")],
        "schedule_waiting/counts_the_samples_it_will_fork"),
    bug("a budget of 0 still admits a sequence", [
        ("            if budget == 0 or self.running_slots", "            if self.running_slots")],
        "schedule_waiting/admits_within_the_budget"),
    bug("the watermark is never kept", [
        ("            use_watermark = bool(self.running)  # alone in the pool, a sequence may use all of it\n",
         "            use_watermark = False\n")],
        "schedule_waiting/keeps_the_watermark"),
    bug("the watermark is kept even when nothing runs", [
        ("            use_watermark = bool(self.running)  # alone in the pool, a sequence may use all of it\n",
         "            use_watermark = True\n")],
        "schedule_waiting/waives_the_watermark_only_when_nothing_runs"),
    bug("whether anything runs is decided once, before the loop", [
        ("            use_watermark = bool(self.running)  # alone in the pool, a sequence may use all of it\n", ""),
        ("        for seq in line:\n", "        use_watermark = bool(self.running)\n        for seq in line:\n")],
        "schedule_waiting/waives_the_watermark_only_when_nothing_runs"),
    bug("prefix hits are computed again", [
        ("                first = seq.num_computed_tokens + len(hits) * self.block_size\n",
         "                first = seq.num_computed_tokens\n")],
        "schedule_waiting/starts_after_prefix_hits", "engine/serves_swaps_samples_and_prefix_hits"),
    bug("the prefix cache is never asked", [
        ("                hits = self.bm.prefix_hits(seq)\n", "                hits = []\n")],
        "schedule_waiting/starts_after_prefix_hits"),
    bug("an admitted sequence is not moved to the running queue", [
        ("            self.move(seq, SequenceStatus.RUNNING)\n", "")],
        "schedule_waiting/admits_within_the_budget", "engine/serves_chunked_prefills_and_recomputation"),
]
