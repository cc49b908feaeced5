"""The text of rollout.py's "fewshot" prompt (an instruction and three worked examples), and of
eval.py's no-search prompts (rag and direct), few-shot and chat."""

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

# eval.py's no-search modes. Few-shot (plain continuation, for small models): the same two questions
# as rollout's search examples, answered from the question alone (direct) or from passages given up
# front (rag), each passage block in the observation's format. The question comes last in both: SmolLM2-135M
# then opens with <answer>; with the passages after the question it starts a new question.
FEWSHOT_DIRECT = (
    "Answer the question. Give the final answer as <answer> answer </answer>.\n\n"
    "Question: In which city was Talia Wrenn born?\n"
    "<answer> Orvale </answer>\n\n"
    "Question: In what year was the founder of Brisco Mining born?\n"
    "<answer> 1890 </answer>\n\n"
    "Question: {question}\n")
FEWSHOT_RAG = (
    "Answer the question using the documents between <information> and </information>. Give the "
    "final answer as <answer> answer </answer>.\n\n"
    "<information>Doc 1(Title: \"Talia Wrenn\") Talia Wrenn is a painter who was born in Orvale "
    "in 1961.</information>\n"
    "Question: In which city was Talia Wrenn born?\n"
    "<answer> Orvale </answer>\n\n"
    "<information>Doc 1(Title: \"Brisco Mining\") Brisco Mining was founded by Ada Pell in 1921.\n"
    "Doc 2(Title: \"Ada Pell\") Ada Pell was born in Kessan in 1890.</information>\n"
    "Question: In what year was the founder of Brisco Mining born?\n"
    "<answer> 1890 </answer>\n\n"
    "<information>{passages}</information>\n"
    "Question: {question}\n")
# The Search-R1 prompt's wording (one chat message), minus the search instructions.
CHAT_DIRECT = ("Answer the given question. Provide the answer inside <answer> and </answer>, without "
               "detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}")
CHAT_RAG = ("Answer the given question using the documents below. Provide the answer inside <answer> "
            "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>.\n"
            "<information>{passages}</information>\nQuestion: {question}")
