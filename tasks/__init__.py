"""tasks: the experiment's data, where a student changes it (as nanochat keeps tasks/gsm8k.py).

    toy_world.py  the synthetic "toy world" data.py caches: its people, cities, countries and
                  companies, the passage templates and distractors, the question kinds, the
                  train/test split by country, and the checks that read the world back
    searcher.py   the noisy scripted searcher whose episodes sft.py warm-starts a policy on
                  (the LLD lab's recipe; the lab itself is in experiments/lab/)
"""
