#!/usr/bin/env bash
# A lent GPU machine's checks, in stages that each fit one call of the device tool (10 minutes).
#
# The lent machine has torch, pytest, psutil, msgpack and cloudpickle, no network, and none of dask's packages:
# `wheels` (here, with network) downloads them for its Python into .whl/ (ignored by git: carry it), with DeepSpeed
# (gpu_peers' peer) built as a pure-Python wheel and its requirements in .whl/peers/, and every other stage (there)
# installs them and the repository without network first (`peers` the peer's too; `sweep`, `sweep4` and `attention`
# transformers, from .whl/hf, which holds its requirements less those .whl/peers has). Results go to $OUT (the files
# the device tool brings back), else to benchmarks/results/.
#
#   bash benchmarks/gpu_lease.sh wheels                 # here, once
#   bash benchmarks/gpu_lease.sh tests                  # there: tests/test_gpu.py and tests/test_ipc.py
#   bash benchmarks/gpu_lease.sh swap|copies|update|sweep|sweep4|attention|calls|count|peers
#   bash benchmarks/gpu_lease.sh lease                  # there: what one 10-minute call of a 15-minute lease holds
#   bash benchmarks/gpu_lease.sh profile                # there: the GPU tests, gpu_swap's 16k row traced, where its
#                                                       # time went, and microbatch_cost's quick rows (the host's cost
#                                                       # per pack call)
#   bash benchmarks/gpu_lease.sh spy                    # there: the 16k row's worker sampled by py-spy (Python
#                                                       # frames), summarized by benchmarks/stacks.py
#   bash benchmarks/gpu_lease.sh planned                # there: the 16k row as planned, with values copied ahead
#                                                       # and sent behind or not (weights alone prefetched), and bf16
set -euo pipefail
cd "$(dirname "$0")/.."
stages="wheels, tests, swap, copies, update, sweep, sweep4, attention, calls, count, peers, lease, profile, spy, planned"
stage="${1:?a stage: $stages}"
python=python3
wheels=(dask==2026.8.0 distributed==2026.8.0 bokeh==3.9.2 tornado==6.6.1 partd==1.4.2 locket==1.0.0 tblib==3.2.2
        zict==3.0.0 xyzservices==2026.9.1 dask-cuda)
peer=deepspeed==0.19.8  # gpu_peers' peer: an sdist, built here as a pure-Python wheel (DS_BUILD_OPS=0: no ops)
peer_wheels=(einops hjson ninja py-cpuinfo pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
             typing-extensions numpy tqdm packaging)  # its requirements beyond what the lent machine has
hf=transformers==5.24.0  # gpu_sweep's and attention's models, from configs (its requirements into .whl/hf)
binary=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if [[ "$stage" == wheels ]]; then
    mkdir -p .whl/peers .whl/spy .whl/hf
    "$python" -m pip download -q --no-deps "${binary[@]}" -d .whl "${wheels[@]}"
    "$python" -m pip download -q --no-deps "${binary[@]}" -d .whl/peers "${peer_wheels[@]}"
    "$python" -m pip download -q --no-deps "${binary[@]}" -d .whl/spy py-spy  # the spy stage's sampler
    DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w .whl/peers "$peer"
    "$python" -m pip download -q "${binary[@]}" -d .whl/hf "$hf"
    for wheel in .whl/hf/*.whl; do  # one copy of each (the carried paths hold 64 MiB in all)
        [[ -e ".whl/peers/$(basename "$wheel")" ]] && rm "$wheel"
    done
    ls .whl .whl/peers .whl/hf
    du -sh .whl
    exit
fi

out="${OUT:-benchmarks/results}"
mkdir -p "$out"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
"$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .  # harmony.runtime maps to runtime/
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"  # dask's CLI
"$python" -c "import torch; assert torch.cuda.is_available(), 'no GPU here'; print(torch.cuda.get_device_name(0))"

models() {  # transformers and its requirements, resolved against what the lent machine has
    "$python" -m pip install -q --no-index --no-compile --no-cache-dir --find-links .whl/hf --find-links .whl/peers \
        "$hf"
}

run() {  # run NAME SECONDS COMMAND...: its output to $out/NAME.log, its JSON to $out/NAME.json
    local name="$1" seconds="$2"
    shift 2
    echo "== $name (at most $seconds s)"
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log" | tail -40 || echo "== $name: exit ${PIPESTATUS[0]}"
}

case "$stage" in
    tests) run tests 540 "$python" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_ipc.py ;;
    swap) run gpu_swap 540 "$python" -m benchmarks.gpu_swap --batches 4096,16384 --microbatch 1024 \
              --out "$out/gpu_swap.json" ;;
    copies) run gpu_copies 240 "$python" -m benchmarks.gpu_copies --out "$out/gpu_copies.json" ;;
    update) run device_update 540 "$python" -m benchmarks.device_update --device cuda:0 \
                --out "$out/device_update.json" ;;
    sweep) models; run gpu_sweep 540 "$python" -m benchmarks.gpu_sweep --out "$out/gpu_sweep.json" ;;
    sweep4) models; run gpu_sweep 300 "$python" -m benchmarks.gpu_sweep --models 4 --layers 12 \
                --out "$out/gpu_sweep.json" ;;
    attention) models; run attention 300 "$python" -m benchmarks.attention --device cuda --out "$out/attention.json" ;;
    calls) run microbatch_cost 300 "$python" -m benchmarks.microbatch_cost --device cuda:0 \
               --out "$out/microbatch_cost.json" ;;
    count) run microbatch_count 400 "$python" -m benchmarks.microbatch_count --device cuda:0 --quick \
               --out "$out/microbatch_count.json" ;;
    peers)
        installed=()  # the peer's requirements, less those the lent machine has already
        for wheel in .whl/peers/*.whl; do
            module="$(basename "$wheel" | cut -d- -f1)"
            case "$module" in numpy|tqdm|packaging|typing_extensions)
                "$python" -c "import $module" 2>/dev/null && continue ;;
            esac
            installed+=("$wheel")
        done
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peer \
            "${installed[@]}"
        PYTHONPATH="$PYTHONPATH:/tmp/peer" run gpu_peers 540 "$python" -m benchmarks.gpu_peers \
            --out "$out/gpu_peers.json"
        ;;
    lease)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        limit=()  # pytest-timeout, where installed, ends a hung test rather than the lease
        "$python" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 120)
        run tests 230 "$python" -m pytest -q -p no:cacheprovider --durations 8 "${limit[@]}" tests/test_gpu.py \
            tests/test_ipc.py
        run gpu_swap 220 "$python" -m benchmarks.gpu_swap --batches 16384 --microbatch 1024 --ways "as planned" \
            --budgets 0.25,0.25+activations --out "$out/gpu_swap.json"
        run device_update 110 "$python" -m benchmarks.device_update --device cuda:0 --quick --rounds 1 \
            --out "$out/device_update.json"
        ;;
    profile)
        limit=()
        "$python" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 100)
        run tests 160 "$python" -m pytest -q -p no:cacheprovider --durations 5 "${limit[@]}" tests/test_gpu.py \
            tests/test_ipc.py
        run gpu_swap 130 "$python" -m benchmarks.gpu_swap --batches 16384 --microbatch 1024 \
            --ways "harmony, as planned" --profile /tmp/traces --out "$out/gpu_swap_traced.json"
        for trace in /tmp/traces/*/profile-*.json; do
            "$python" -m benchmarks.trace_summary "$trace" --top 25 | tee -a "$out/trace_summary.log"
            gzip -c "$trace" > "$out/$(basename "$(dirname "$trace")")-$(basename "$trace").gz"
        done
        run microbatch_cost 120 "$python" -m benchmarks.microbatch_cost --device cuda:0 --quick \
            --out "$out/microbatch_cost.json"
        ;;
    planned)  # the 16k row as planned with values ahead and behind, with weights alone prefetched, and in bf16
        run gpu_swap 420 "$python" -m benchmarks.gpu_swap --batches 16384 --microbatch 1024 --ways "as planned" \
            --out "$out/gpu_swap_planned.json" ;;
    spy)  # the 16k row's worker sampled (Python frames): where its host time between kernels goes
        "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/spy/*.whl
        run gpu_swap 200 py-spy record --subprocesses --threads --idle --nonblocking --format raw \
            --rate 200 -o "$out/stacks.txt" -- "$python" -m benchmarks.gpu_swap --batches 16384 --microbatch 1024 \
            --ways "harmony, as planned" --out "$out/gpu_swap_sampled.json"
        if [[ -s "$out/stacks.txt" ]]; then
            "$python" -m benchmarks.stacks "$out/stacks.txt" --top 60 | tee "$out/stacks_summary.log" | head -90
        else
            echo "== spy: py-spy wrote no stacks (it may not be allowed to trace processes here)"
        fi
        ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
