from lab_bugs import bug

BUGS = [
    bug("lookup trusts the name and never compares the tokens", [
        ("        return entry if entry is not None and entry.tokens == tokens else None\n", "        return entry\n")],
        "tier/checks_the_tokens"),
    bug("touch does nothing, so the tier evicts first in, first out", [
        ("        self._kept[name] = self._kept.pop(name)  # to the end: the most recently used\n", "        pass\n")],
        "tier/evicts_the_least_recently_used", "tier/random_workload"),
    bug("evict_one takes the most recently used block", [
        ("        for name, entry in self._kept.items():\n            if self.allocator.ref_count(entry.block_id) == 1:",
         "        for name, entry in reversed(self._kept.items()):\n            if self.allocator.ref_count(entry.block_id) == 1:")],
        "tier/evicts_the_least_recently_used", "engine/evicts_under_pressure"),
    bug("evict_one evicts a block a move of this step holds", [
        ("            if self.allocator.ref_count(entry.block_id) == 1:  # more: a move of this step holds it\n",
         "            if True:\n")],
        "tier/spares_held_blocks", "engine/evicts_under_pressure"),
    bug("evict_one forgets the block without freeing it", [
        ("                del self._kept[name]\n                self.allocator.free(entry.block_id)\n",
         "                del self._kept[name]\n")],
        "tier/evicts_the_least_recently_used", "engine/evicts_under_pressure"),
    bug("evict_one frees the block but keeps it listed", [
        ("                del self._kept[name]\n                self.allocator.free(entry.block_id)\n",
         "                self.allocator.free(entry.block_id)\n")],
        "tier/evicts_the_least_recently_used", "engine/evicts_under_pressure"),
    bug("put takes a reference of its own", [
        ("        self._kept[name] = CachedBlock(name, host_block, tokens)\n",
         "        self._kept[name] = CachedBlock(name, self.allocator.fork(host_block), tokens)\n")],
        "tier/keeps_and_finds_blocks", "engine/copies_a_returning_conversation_back"),
    bug("`in` asks about block ids, not names", [
        ("        return name in self._kept\n", "        return any(e.block_id == name for e in self._kept.values())\n")],
        "tier/keeps_and_finds_blocks"),
    bug("evict_one says it evicted when it found nothing", [
        ("                return True\n        return False\n", "                return True\n        return True\n")],
        "tier/evicts_the_least_recently_used", "tier/spares_held_blocks", "engine/evicts_under_pressure"),
    bug("iterating the tier yields names, not blocks", [
        ("        return iter(list(self._kept.values()))\n", "        return iter(list(self._kept))\n")],
        "tier/keeps_and_finds_blocks", "engine/copies_a_returning_conversation_back"),
    bug("num_cached reads the host pool instead of the tier", [
        ("        return len(self._kept)\n", "        return self.allocator.num_used\n")],
        "tier/keeps_and_finds_blocks"),
    bug("evict_one looks for blocks nobody references (count 0), not those only the tier holds (1)", [
        ("            if self.allocator.ref_count(entry.block_id) == 1:  # more: a move of this step holds it\n",
         "            if self.allocator.ref_count(entry.block_id) == 0:\n")],
        "tier/evicts_the_least_recently_used", "tier/spares_held_blocks", "engine/evicts_under_pressure"),
    bug("lookup makes the block the most recently used", [
        ("        entry = self._kept.get(name)\n",
         "        if name in self._kept:\n            self._kept[name] = self._kept.pop(name)\n        entry = self._kept.get(name)\n")],
        "tier/evicts_the_least_recently_used"),
    bug("evict_one gives up at the first held block instead of skipping it", [
        ("                self.allocator.free(entry.block_id)\n                return True\n",
         "                self.allocator.free(entry.block_id)\n                return True\n            return False\n")],
        "tier/spares_held_blocks"),
]
