# dflash-flow tasks. `just --list` shows them.

python := "python"

# Install everything: the package with its dev tools, then the reference packages the tests compare against.
setup:
    {{python}} -m pip install -e ".[dev]"
    {{python}} -m pip install --no-deps -r requirements/reference.txt

# Run the whole test suite (unit, property and end-to-end tests).
test *ARGS:
    {{python}} -c "import dflash" 2>/dev/null || {{python}} -m pip install -q --no-deps -r requirements/reference.txt
    {{python}} -m pytest -q {{ARGS}}

# Lint and check formatting-level problems.
lint:
    {{python}} -m ruff check dflash_flow tests bench examples

# Benchmarks: each writes bench/results/NAME.json and prints it (scale before profile: the split plan
# reads the all-reduce wait scale.json measured). About 10 minutes on 2 cores.
bench:
    {{python}} bench/runtime_bench.py
    {{python}} bench/batching_bench.py
    {{python}} bench/data_scale_bench.py
    {{python}} bench/model_bench.py
    {{python}} bench/monitor_bench.py
    {{python}} bench/peer_step.py
    {{python}} bench/peer_train.py
    {{python}} bench/variants_bench.py
    {{python}} bench/scale_bench.py
    {{python}} bench/profile_bench.py
    {{python}} bench/e2e_bench.py
    {{python}} bench/fanout_bench.py
    {{python}} bench/torchdata_bench.py

# Train the embedded default drafter on CPU.
run FILE="pipelines/dflash.yaml" *ARGS:
    dflash-flow run {{FILE}} {{ARGS}}

# Open the MLflow UI on the local store.
ui PORT="5000":
    mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port {{PORT}} --workers 1
