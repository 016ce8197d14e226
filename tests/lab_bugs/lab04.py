from lab_bugs import bug

BUGS = [
    bug("running sequences compute one token a step", [
        ("            num_new = min(seq.num_uncomputed_tokens, budget)\n            if num_new == 0:",
         "            num_new = min(1, budget)\n            if num_new == 0:")],
        "schedule_running/chunked_prefill"),
    bug("the running loop never spends the budget", [
        ("                self.start(seq, num_new, end, out)\n                budget -= num_new\n",
         "                self.start(seq, num_new, end, out)\n")],
        "schedule_running/chunked_prefill", "engine/serves_chunked_prefills_and_recomputation"),
    bug("a sequence preempted earlier in the loop is still scheduled", [
        ("            if seq.status is not SequenceStatus.RUNNING:\n                continue  # preempted earlier in this loop\n",
         "")],
        "schedule_running/victim_in_the_loop", "engine/serves_chunked_prefills_and_recomputation"),
    bug("make_room's answer is ignored", [
        ("            if self.make_room(seq, end, out):\n                self.start(seq, num_new, end, out)\n"
         "                budget -= num_new\n",
         "            self.make_room(seq, end, out)\n            self.start(seq, num_new, end, out)\n"
         "            budget -= num_new\n")],
        "schedule_running/own_victim", "engine/serves_chunked_prefills_and_recomputation"),
    bug("the waiting queue goes before the swapped one", [
        ("        line = sorted(self.swapped + self.waiting, key=lambda s: (s.arrival_time, s.seq_id))\n",
         "        line = self.waiting + self.swapped\n")],
        "schedule_waiting/fcfs_across_queues"),
    bug("a sequence that does not fit is skipped, so newer ones overtake it", [
        ("                if not self.bm.can_swap_in(seq, end, use_watermark):\n                    break\n",
         "                if not self.bm.can_swap_in(seq, end, use_watermark):\n                    continue\n"),
        ("                if not self.bm.can_admit(seq, hits, end, use_watermark):\n                    break\n",
         "                if not self.bm.can_admit(seq, hits, end, use_watermark):\n                    continue\n")],
        "schedule_waiting/nobody_overtakes"),
    bug("a waiting sequence that does not fit is skipped, so a newer one is admitted first", [
        ("                if not self.bm.can_admit(seq, hits, end, use_watermark):\n                    break\n",
         "                if not self.bm.can_admit(seq, hits, end, use_watermark):\n                    continue\n")],
        "schedule_waiting/nobody_overtakes"),
    bug("a swapped sequence that does not fit is skipped, so a newer one overtakes it", [
        ("                if not self.bm.can_swap_in(seq, end, use_watermark):\n                    break\n",
         "                if not self.bm.can_swap_in(seq, end, use_watermark):\n                    continue\n")],
        "schedule_waiting/nobody_overtakes"),
    bug("max_num_seqs counts sequences, not the samples they will fork", [
        ("self.running_slots + seq.num_slots > self.config.max_num_seqs",
         "len(self.running) + 1 > self.config.max_num_seqs")],
        "schedule_waiting/max_num_seqs"),
    bug("a budget of 0 still admits a sequence", [
        ("            if budget == 0 or self.running_slots", "            if self.running_slots")],
        "schedule_waiting/budget"),
    bug("the watermark is never kept", [
        ("            use_watermark = bool(self.running)  # alone in the pool, a sequence may use all of it\n",
         "            use_watermark = False\n")],
        "schedule_waiting/watermark"),
    bug("the watermark is kept even when nothing runs", [
        ("            use_watermark = bool(self.running)  # alone in the pool, a sequence may use all of it\n",
         "            use_watermark = True\n")],
        "schedule_waiting/watermark_waived"),
    bug("whether anything runs is decided once, before the loop", [
        ("            use_watermark = bool(self.running)  # alone in the pool, a sequence may use all of it\n", ""),
        ("        for seq in line:\n", "        use_watermark = bool(self.running)\n        for seq in line:\n")],
        "schedule_waiting/watermark_waived"),
    bug("prefix hits are computed again", [
        ("                first = seq.num_computed_tokens + len(hits) * self.block_size\n",
         "                first = seq.num_computed_tokens\n")],
        "schedule_waiting/prefix_hits", "engine/serves_swaps_samples_and_prefix_hits"),
    bug("the prefix cache is never asked", [
        ("                hits = self.bm.prefix_hits(seq)\n", "                hits = []\n")],
        "schedule_waiting/prefix_hits"),
    bug("an admitted sequence is not moved to the running queue", [
        ("            self.move(seq, SequenceStatus.RUNNING)\n", "")],
        "schedule_waiting/budget", "engine/serves_chunked_prefills_and_recomputation"),
    bug("ties in arrival time go to the waiting queue, not by seq_id", [
        ("        line = sorted(self.swapped + self.waiting, key=lambda s: (s.arrival_time, s.seq_id))\n",
         "        line = sorted(self.waiting + self.swapped, key=lambda s: s.arrival_time)\n")],
        "schedule_waiting/arrival_ties"),
    bug("swapped sequences always go first, whatever their arrival time", [
        ("        line = sorted(self.swapped + self.waiting, key=lambda s: (s.arrival_time, s.seq_id))\n",
         "        line = self.swapped + self.waiting\n")],
        "schedule_waiting/arrived_earlier"),
    bug("the line is ordered by seq_id (when a sequence was added), not by arrival time", [
        ("key=lambda s: (s.arrival_time, s.seq_id))", "key=lambda s: s.seq_id)")],
        "schedule_waiting/arrived_earlier"),
    bug("the budget check is off by one: a sequence is admitted only while more than 1 token is left", [
        ("            if budget == 0 or self.running_slots", "            if budget <= 1 or self.running_slots")],
        "schedule_waiting/budget"),
    bug("a running sequence takes the whole budget left, past its uncomputed tokens", [
        ("            num_new = min(seq.num_uncomputed_tokens, budget)\n            if num_new == 0:",
         "            num_new = budget\n            if num_new == 0:")],
        "schedule_running/chunked_prefill"),
    bug("max_num_seqs is allowed to be exceeded by one place", [
        ("self.running_slots + seq.num_slots > self.config.max_num_seqs",
         "self.running_slots + seq.num_slots > self.config.max_num_seqs + 1")],
        "schedule_waiting/max_num_seqs"),
]
