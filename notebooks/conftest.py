# Lessons 07 and 09 run end to end in tests/test_lesson_verdicts.py, which also recomputes every verdict
# they print from the measurements they keep; nbval would only run them a second time.
collect_ignore = ["07_choosing_swap_or_recompute.ipynb", "09_serving_long_contexts.ipynb"]
