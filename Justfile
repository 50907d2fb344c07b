# dflash-flow tasks. `just --list` shows them.

python := "python"

# Install everything: the package with its dev tools at the versions CI runs (requirements/cpu.txt), then the
# reference packages the tests compare against.
setup:
    {{python}} -m pip install -e ".[dev]" -c requirements/cpu.txt
    {{python}} -m pip install --no-deps -r requirements/reference.txt

# Unit, property and fast end-to-end tests (~5 min on 2 cores); `just test-slow` the rest (~22-35 min); CI runs both.
test *ARGS:
    {{python}} -c "import dflash" 2>/dev/null || {{python}} -m pip install -q --no-deps -r requirements/reference.txt
    {{python}} -m pytest -q -m "not slow" {{ARGS}}

# The slow end-to-end tests: real CLI runs, torchrun jobs, the SIGKILL/resume matrix, the benches' smoke runs.
test-slow *ARGS:
    {{python}} -c "import dflash" 2>/dev/null || {{python}} -m pip install -q --no-deps -r requirements/reference.txt
    {{python}} -m pytest -q -m slow {{ARGS}}

# Lint and check formatting-level problems.
lint:
    {{python}} -m ruff check dflash_flow tests bench examples

# Benchmarks (bench/run_all.py): each writes bench/results/NAME.json, with the command and the machine's
# load; the SpecForge wheel (by hash) and the torchdata extra are fetched / installed first. The default set
# takes ~15 min on 2 cores; `just bench --long` adds the long comparisons (same-data training against
# SpecForge, the variants, data at scale: ~1 h more); `just bench --list`, `just bench --only peer_step,e2e`.
bench *ARGS:
    {{python}} bench/run_all.py {{ARGS}}

# Real-engine interop (not part of `test`): vLLM's CPU build, hash-pinned, in its own environment ($INTEROP_VENV,
# default .venv-interop; first time ~5 min, 3.5 GB); trains a short drafter (or `--export DIR`), then vLLM's DFlash
# speculative decoding of 16 held-out prompts against plain vLLM, transformers and ours, drafts step by step, and
# both exports through vLLM's weight loaders (bench/results/interop.json, ~8 min on 2 cores).
# Then regeneration through a real vLLM server (as interop-regenerate, ~6 min); ARGS go to the first check.
interop *ARGS:
    {{python}} interop/check.py {{ARGS}}
    {{python}} interop/regenerate_check.py
    {{python}} interop/eval_check.py
    {{python}} interop/engine_target_check.py

# Regeneration through a real vLLM server (vLLM's CPU build, the same environment): `regenerate --server` vs
# in process on the same prompts (replies equal, tokens/s of both), a server SIGKILLed mid-run and a resume.
# Writes bench/results/regenerate_vllm.json. ~6 min on 2 cores (two server starts); --no-kill: one.
interop-regenerate *ARGS:
    {{python}} interop/regenerate_check.py {{ARGS}}

# Train the embedded default drafter on CPU.
run FILE="pipelines/dflash.yaml" *ARGS:
    dflash-flow run {{FILE}} {{ARGS}}

# Open the MLflow UI on the local store.
ui PORT="5000":
    mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port {{PORT}} --workers 1
