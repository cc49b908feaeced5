"""tasks: the experiment's data, where a student changes it (as nanochat keeps tasks/gsm8k.py).

    toy_world.py  the synthetic "toy world" data.py caches: its people, cities, countries and
                  companies, the passage templates and distractors, the question kinds, the
                  train/test split by country, and the checks that read the world back
    lab.py        the LLD lab's setting: its tokenizer and ~1M-parameter Llama (pretrained on the
                  toy world's text), the SFT/RL question split, and the noisy scripted searcher
                  whose episodes sft.py warm-starts it on (docs/lab/prereg.md)
"""
