# Lessons 06, 07 and 09 time what they compare: tests/test_lesson_verdicts.py runs each of them twice end
# to end, requires the same verdicts from both runs and recomputes them from the measurements they keep;
# nbval would only run them a third time.
collect_ignore = ["06_preemption_swap_recompute.ipynb", "07_choosing_swap_or_recompute.ipynb",
                  "09_serving_long_contexts.ipynb"]
