"""The text of rollout.py's "fewshot" prompt: an instruction and three worked examples."""

# Two worked examples (no <think>: a 135M model's reasoning adds tokens, not accuracy). They are
# tokenised piece by piece exactly as the environment tokenises an episode (model turns and
# observations separately), so they show the model the very token patterns of its own episodes.
FEWSHOT_INSTRUCTION = ("Answer the question. Search with <search> query </search>; results come back "
                       "between <information> and </information>. Give the final answer as "
                       "<answer> answer </answer>.\n\n")
# (question, steps): a step is (action, argument, passages shown for a search), or ("note", text,
# None), a sentence written before the next action. The notes restate the evidence ("X was born in
# Y.") before answering: SmolLM2-135M copies a sentence it has just seen far more reliably than it
# picks a span out of three passages, and without them it answered most questions with a year
# (toy single-hop questions, greedy: EM 0.03 without notes, 0.12 with; 32 questions).
FEWSHOT_EXAMPLES = [
    ("Where was Talia Wrenn born?", [
        ("search", "Talia Wrenn", ['"Talia Wrenn"\nTalia Wrenn is a painter who was born in Orvale in 1961. '
                                   'She works for Kelmar Foods.',
                                   '"Talia Wrenne"\nTalia Wrenne (born 1948) is a pilot from Dostrava.']),
        ("note", "Talia Wrenn was born in Orvale.", None),
        ("answer", "Orvale", None)]),
    ("Which company does Doran Vesk work for?", [
        ("search", "Doran Vesk", ['"Doran Vesk"\nDoran Vesk (born 1974) is a chemist from Pellin. '
                                  'Doran Vesk has worked at Trimble Motors since 2003.',
                                  '"Trimble Motors"\nTrimble Motors was founded by Ada Pell in 1921.']),
        ("note", "Doran Vesk has worked at Trimble Motors.", None),
        ("answer", "Trimble Motors", None)]),
    ("In what year was the founder of Brisco Mining born?", [
        ("search", "founder of Brisco Mining", ['"Brisco Mining"\nBrisco Mining was founded by Ada Pell in 1921.']),
        ("note", "Brisco Mining was founded by Ada Pell.", None),
        ("search", "Ada Pell", ['"Ada Pell"\nAda Pell was born in Kessan in 1890.']),
        ("note", "Ada Pell was born in 1890.", None),
        ("answer", "1890", None)]),
]
