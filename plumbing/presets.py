"""train.py's presets (--preset NAME), all of them: the paper's settings; one-GPU presets of the
same algorithm with a smaller batch, each sized by the memory plan (plumbing/memory_plan.py) for
one card of 24, 48, 80 or 141 GB; and the LLD lab's RL settings (experiments/lab/prereg.md).

`--preset paper` is the LLDS paper's setting (section 4: Qwen2.5-3B-Instruct, NQ + HotpotQA, the E5
retriever as a server, 512 prompts x 5 a step), run on one device: about 4 weeks on one H100 (the
plan's estimate). It follows the authors' code where that is cheap and copies no bug: their
warm-up (their first step at lr 0) and their mini-batch order (plumbing/minibatches.py). Where it
still differs from their code: docs/method.md's table.
`--preset one-gpu-<size>-<card>` keeps every algorithm setting of it (the search-r1 prompt, 3
searches of top-3 passages, 500-token turns and observations, T = 1 with top-p 0.95 (the authors'
rollout setting), lr 1e-6, warm-up 0.285 from lr 0, clip 0.2, KL and entropy 0.001, LLDS lambda 0.2
with the action gate, 10 updates a step in the authors' order) on 64 prompts x 5 a step, with:
- max_prompt_tokens 512: Search-R1's prompts are ~180 Qwen tokens, and the bound sets the plan;
- the rollout batch (and the micro-batch) the plan fits into 85% of the card, from `--plan` on
  bench/configs/<model>'s config: planned peaks and times are in README.md's GPU section;
- LoRA, rank 32 on every attention and MLP linear layer at lr 1e-5 (10x the paper's, as "LoRA
  Without Regret" (Thinking Machines, 2025) finds LoRA wants), where full fine-tuning cannot fit the
  card: one-gpu-1.5b-24gb, one-gpu-3b-24gb and one-gpu-3b-48gb; the others fine-tune all weights;
- the displacement pass every 10 steps (+12% of a step when run every step), 200 steps, 500
  held-out questions every 50 steps, and 2 checkpoints (the older without its optimizer state).
"""

PAPER = dict(
    model="Qwen/Qwen2.5-3B-Instruct", data="data/nq_hotpotqa_train/train.parquet",
    eval_data="data/nq_hotpotqa_train/test.parquet", retriever="http://127.0.0.1:8000/retrieve", template="search-r1",
    max_turns=3, topk=3, max_turn_tokens=500, max_obs_tokens=500, max_prompt_tokens=2048, max_context=4096,
    temperature=1.0, top_p=0.95, steps=1005, prompts_per_step=512, group_size=5, drop_tied_groups=0, mini_batch_size=256,
    micro_batch_size=4, lr=1e-6, warmup_ratio=0.285, clip_eps=0.2, kl_coef=0.001, entropy_coef=0.001, llds_lambda=0.2,
    llds_gate="action", eval_every=50, eval_size=1000, eval_max_turns=4, ckpt_every=50, rollout_batch_size=128,
    grad_checkpointing=True, warmup_from_zero=True, verl_minibatches=True)

ONE_GPU = {**PAPER, "max_prompt_tokens": 512, "steps": 200, "prompts_per_step": 64, "mini_batch_size": 32,
           "displacement_every": 10, "token_view_every": 50, "eval_size": 500, "keep_ckpts": 2}

# (model size, card) -> (rollout_batch_size, micro_batch_size, lora_rank: 0 = full fine-tuning),
# chosen with the memory plan (tests/test_memory_plan.py checks each fits in 85% of its card, that
# the next larger rollout batch of these steps, or twice the micro-batch up to 8, would not, and
# that full fine-tuning would not fit where LoRA is used).
SIZED = {("0.5b", "24gb"): (80, 8, 0), ("0.5b", "48gb"): (320, 8, 0),
         ("0.5b", "80gb"): (320, 8, 0), ("0.5b", "141gb"): (320, 8, 0),
         ("1.5b", "24gb"): (80, 8, 32), ("1.5b", "48gb"): (80, 4, 0),
         ("1.5b", "80gb"): (160, 8, 0), ("1.5b", "141gb"): (320, 8, 0),
         ("3b", "24gb"): (40, 4, 32), ("3b", "48gb"): (80, 8, 32),
         ("3b", "80gb"): (80, 2, 0), ("3b", "141gb"): (160, 8, 0)}

GPU_PRESETS = {"paper": PAPER, **{
    f"one-gpu-{size}-{card}": {**ONE_GPU, "model": f"Qwen/Qwen2.5-{size.upper()}-Instruct",
                               "rollout_batch_size": rollout, "micro_batch_size": micro,
                               **({"lora_rank": rank, "lr": 1e-5} if rank else {})}
    for (size, card), (rollout, micro, rank) in SIZED.items()}}
# The card each one-GPU preset is sized for: `--plan` plans against it on a machine without a GPU.
CARD = {f"one-gpu-{size}-{card}": card for size, card in SIZED}

# The LLD lab: the paper's RL settings on a ~1M-parameter model warm-started by sft.py. Its runner
# (experiments/lab/lab_runs.py) passes --model (the SFT folder), --data and --corpus (the lab's folder), --lr
# and --mini-batch-size.
LAB = dict(
    template="search-r1", max_turns=2, topk=3, max_turn_tokens=24, max_obs_tokens=200,
    temperature=1.0, steps=300, prompts_per_step=8, group_size=5, drop_tied_groups=0,
    micro_batch_size=10, rollout_batch_size=64, warmup_ratio=0.285, clip_eps=0.2, kl_coef=0.001,
    entropy_coef=0.001, grad_clip=1.0, llds_lambda=0.2, llds_gate="action",
    llds_reduction="token-mean", eval_every=50, eval_size=100, eval_samples=4, eval_max_turns=2,
    ckpt_every=25, keep_ckpts=1, samples_per_step=2, bf16=False, token_view_every=50)

PRESETS = {**GPU_PRESETS, "lab": LAB}
