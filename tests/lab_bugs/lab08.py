from lab_bugs import bug

TIMED_CALL = ("    best = [math.inf] * len(fns)\n    for _ in range(rounds):\n        for i, fn in enumerate(fns):\n"
              "            start = clock()\n            fn()\n            best[i] = min(best[i], clock() - start)\n")
RECOMPUTE_PRICE = "        recompute = cost.recompute_seconds(context.num_tokens, context.batch_tokens)\n"
HOST_ROOM = "        if context.host_free_blocks < context.num_host_blocks:\n"
WARM_UP = "    for fn in fns:  # warm-up: allocations and cold caches, not timed\n        fn()\n"
SWAP_PRICE = "        swap = cost.swap_seconds(context.num_host_blocks, context.block_bytes)\n"
FORWARD_FIT = ("    known = np.array([[n, attention_pairs(n), 1.0] for n in victim_tokens], dtype=float)\n"
               "    per_token, per_pair, call = (max(0.0, float(x)) for x in np.linalg.lstsq(known, added, rcond=None)[0])\n")

BUGS = [
    bug("the mean of the rounds, not the best", [(TIMED_CALL, TIMED_CALL.replace("[math.inf]", "[0.0]").replace(
        "best[i] = min(best[i], clock() - start)", "best[i] += (clock() - start) / rounds"))],
        "measure/keeps_the_best"),
    bug("each function timed for all its rounds before the next", [(
        TIMED_CALL, TIMED_CALL.replace("    for _ in range(rounds):\n        for i, fn in enumerate(fns):\n",
                                       "    for i, fn in enumerate(fns):\n        for _ in range(rounds):\n"))],
        "measure/in_turns"),
    bug("the copy line through the origin", [("slope, intercept = np.polyfit(n, seconds, 1)",
                                              "slope, intercept = n @ seconds / (n @ n), 0.0")],
        "fit_swap/host_link", "fit_swap/copy_call"),
    bug("a round trip crosses the link once", [("2 * block_bytes / slope if slope > 0",
                                                "block_bytes / slope if slope > 0")],
        "fit_swap/host_link"),
    bug("a round trip's two copy calls counted as one", [("max(0.0, intercept / 2)", "max(0.0, intercept)")],
        "fit_swap/copy_call"),
    bug("prefill speed from a whole pass over its tokens", [(
        '"prefill_tokens_per_s": 1 / per_token if per_token > 0 else math.inf',
        '"prefill_tokens_per_s": (batch_tokens + victim_tokens[-1]) / with_victim_seconds[-1]')],
        "fit_recompute/prefill_speed"),
    bug("attention left out of the fit", [(
        "    known = np.array([[n, attention_pairs(n), 1.0] for n in victim_tokens], dtype=float)\n"
        "    per_token, per_pair, call = (max(0.0, float(x)) for x in np.linalg.lstsq(known, added, rcond=None)[0])\n",
        "    known = np.array([[n, 1.0] for n in victim_tokens], dtype=float)\n"
        "    per_token, call = (max(0.0, float(x)) for x in np.linalg.lstsq(known, added, rcond=None)[0])\n"
        "    per_pair = 0.0\n")],
        "fit_recompute/prefill_speed", "fit_recompute/attention_per_pair", "fit_recompute/attention_call",
        "fit_recompute/floor"),
    bug("the batch alone not subtracted", [("added = np.asarray(with_victim_seconds, dtype=float) - alone_seconds",
                                            "added = np.asarray(with_victim_seconds, dtype=float)")],
        "fit_recompute/attention_call"),
    bug("the floor left out", [('"floor_seconds": max(0.0, alone_seconds - batch_tokens * per_token)',
                                '"floor_seconds": 0.0')],
        "fit_recompute/floor"),
    bug("the floor is the batch's whole pass", [('"floor_seconds": max(0.0, alone_seconds - batch_tokens * per_token)',
                                                 '"floor_seconds": alone_seconds')],
        "fit_recompute/floor"),
    bug("a tie swaps", [('return "swap" if swap < recompute else "recompute"',
                         'return "swap" if swap <= recompute else "recompute"')],
        "choose_mode/tie_recomputes"),
    bug("recompute priced as a pass of its own", [(RECOMPUTE_PRICE, RECOMPUTE_PRICE.replace(
        "cost.recompute_seconds(context.num_tokens, context.batch_tokens)",
        "cost.pass_seconds(context.num_tokens, attention_pairs(context.num_tokens), 1)"))],
        "choose_mode/in_the_batch", "engine/weight_reads_hide_recompute"),
    bug("recompute priced in a batch of one", [(RECOMPUTE_PRICE, RECOMPUTE_PRICE.replace(
        "(context.num_tokens, context.batch_tokens)", "(context.num_tokens)"))],
        "choose_mode/in_the_batch"),
    bug("host room counted in every block, shared ones too", [(HOST_ROOM, HOST_ROOM.replace("num_host_blocks",
                                                                                             "num_blocks"))],
        "choose_mode/host_room"),
    bug("host room left to the engine", [(HOST_ROOM + '            return "recompute"',
                                          '        if False:\n            return "recompute"')],
        "choose_mode/host_room", "engine/small_host_pool"),
    # boundaries, wrong counts and ties
    bug("the warm-up counted as one of the rounds", [(WARM_UP, ""), (TIMED_CALL, TIMED_CALL.replace(
        "for _ in range(rounds):", "for r in range(rounds):").replace(
        "            best[i] = min(best[i], clock() - start)\n",
        "            if r:  # the first round warms up\n                best[i] = min(best[i], clock() - start)\n"))],
        "measure/one_round"),
    bug("the warm-up left out", [(WARM_UP, "")], "measure/one_round"),
    bug("the attention call left out of the forward fit (no intercept)", [(FORWARD_FIT, FORWARD_FIT.replace(
        "[[n, attention_pairs(n), 1.0]", "[[n, attention_pairs(n)]").replace(
        "per_token, per_pair, call = (", "call, (per_token, per_pair) = 0.0, ("))],
        "fit_recompute/attention_call"),
    bug("a swap priced by every block, those already on the host too", [(SWAP_PRICE, SWAP_PRICE.replace(
        "num_host_blocks", "num_blocks"))],
        "choose_mode/priced_by_what_moves"),
    bug("host room wants a block to spare", [(HOST_ROOM, HOST_ROOM.replace("<", "<="))], "choose_mode/host_room"),
    bug("a tie swaps, the comparison turned around", [('return "swap" if swap < recompute else "recompute"',
                                                       'return "recompute" if recompute < swap else "swap"')],
        "choose_mode/tie_recomputes"),
]
