# Lessons 04, 06, 07, 08 and 09 time what they compare: tests/test_lesson_verdicts.py runs each of them twice
# end to end and requires the same verdicts from both runs (07 and 09: recomputed from the measurements they
# keep); nbval would only run them a third time.
collect_ignore = ["04_engine_loop.ipynb", "06_preemption_swap_recompute.ipynb", "07_choosing_swap_or_recompute.ipynb",
                  "08_preemption_metrics.ipynb", "09_serving_long_contexts.ipynb"]
